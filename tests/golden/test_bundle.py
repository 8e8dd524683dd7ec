"""Golden bundle format: round trips, determinism, safetensors interop, every load failure."""

from __future__ import annotations

import json
import os
import pickle
import struct
import subprocess
import time
import tracemalloc

import ml_dtypes
import numpy as np
import pytest
import safetensors
from safetensors import safe_open
from safetensors.numpy import save_file

from kdtr.golden import atomic, bundle, format as bundle_header
from kdtr.inputs import trees
from kdtr.golden.atomic import atomic_write_bytes, atomic_writer
from kdtr.golden.bundle import Bundle, BundleError, file_sha256, load_bundle, read_meta, save_bundle, tensor_sha256
from kdtr.inputs.problem import Problem
from kdtr.inputs.rng import Stream

B, T, H, PAGE = 2, 5, 2, 4
PREFIX = (3, 6)
PARENTS = ([-1, 0, 1, 2, 3], [-1, 0, 0, 1, 2])  # a chain and a small bushy tree in pop order


def make_problem(kv_dtype="fp32", seed=1) -> Problem:
    """Shuffled pages, NaN in unowned slots, one whole spare NaN page past every block table."""
    need = [-(-(p + T) // PAGE) for p in PREFIX]  # pages per request: 2 and 3
    num_pages, max_pages = sum(need) + 1, max(need) + 1
    perm = Stream(seed, "pages").permutation(num_pages)
    spare = int(perm[-1])
    kv = np.full((num_pages, PAGE, 576), np.nan)
    table = np.full((B, max_pages), spare, dtype=np.int32)
    used = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[used : used + n]
        used += n
        slots = np.arange(PREFIX[b] + T)
        kv[table[b, slots // PAGE], slots % PAGE] = Stream(seed, "kv", b).normalish((slots.size, 576))
    q = Stream(seed, "q").normalish((B, T, H, 576))
    dt = np.float32 if kv_dtype == "fp32" else ml_dtypes.bfloat16
    parent = np.array(PARENTS, dtype=np.int32)
    return Problem(
        q=q.astype(dt), kv_cache=kv.astype(dt), block_table=table,
        prefix_lens=np.array(PREFIX, dtype=np.int32), tree_parent=parent,
        tree_depth=np.stack([trees.depths(p) for p in parent]),
        tree_mask=np.stack([trees.pack_mask(p) for p in parent]), scale=0.1352,
    )


def make_meta(**extra) -> dict:
    meta = {
        "case": "unit-b2-t5", "out_dtype": "bf16", "tree": {"family": "json", "source": "unit"},
        "seed": 7, "tolerances": {"out": {"atol": 1e-3, "rtol": 1e-2}, "lse": {"atol": 1e-4}},
        "generator": "kdtr-test 0", "spec": {"B": B, "T": T, "H": H}, "extra": {"kept": [1, 2.5, None]},
    }
    meta.update(extra)
    return meta


def outputs(seed=1):
    s = Stream(seed, "out")
    logp = -np.sort(s.uniform((B, 15, 4)), axis=-1)[..., ::-1] * 8
    return s.normalish((B, T, H, 512)).astype(np.float32), s.normalish((B, T, H)), logp


def save(path, kv_dtype="fp32", with_logp=True, **meta_extra) -> str:
    out, lse, logp = outputs()
    return save_bundle(path, make_problem(kv_dtype), out, lse, make_meta(**meta_extra),
                       draft_logp=logp if with_logp else None)


def same_bits(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def header_of(path):
    """(header dict, data bytes) of a file, parsed independently of kdtr."""
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def write_header(path, header, data):
    text = json.dumps(header).encode()
    text += b" " * (-(8 + len(text)) % 8)
    open(path, "wb").write(struct.pack("<Q", len(text)) + text + data)


def edit_meta(path, fn):
    """Edit the metadata object and re-sign it (its checksum stays valid), to reach later checks."""
    header, data = header_of(path)
    meta = json.loads(header["__metadata__"]["kdtr"])
    fn(meta)
    header["__metadata__"] = bundle.metadata_strings(json.dumps(meta))
    write_header(path, header, data)


def write_raw(path, tensors: dict, meta: dict):
    """A bundle from arbitrary arrays and metadata, bypassing save_bundle's validation."""
    meta = dict(meta, checksums={n: tensor_sha256(a) for n, a in tensors.items()})
    head = bundle._encode_header(tensors, {"kdtr": json.dumps(meta)})
    open(path, "wb").write(head + b"".join(np.ascontiguousarray(a).tobytes() for a in tensors.values()))


def good_parts(tmp_path):
    """(tensors, meta) of a valid bundle, to be edited by a test and written with write_raw."""
    p = tmp_path / "good.kdtr"
    save(p)
    b = load_bundle(p)
    tensors = {n: getattr(b.problem, n).copy() for n in bundle.TENSOR_ORDER[3:]}
    tensors.update(out=b.out.copy(), lse=b.lse.copy(), draft_logp=b.draft_logp.copy())
    return tensors, b.meta


def expect_error(path, *fragments, **kw) -> str:
    with pytest.raises(BundleError) as info:
        load_bundle(path, **kw)
    msg = str(info.value)
    assert msg.startswith(f"{path}: ") and "\n" not in msg, msg
    for frag in fragments:
        assert frag in msg, msg
    return msg


# ----------------------------------------------------------------------------- happy paths


@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16"])
def test_round_trip_is_bit_exact(tmp_path, kv_dtype):
    path = tmp_path / "a.kdtr"
    problem = make_problem(kv_dtype)
    out, lse, logp = outputs()
    digest = save_bundle(path, problem, out, lse, make_meta(), draft_logp=logp)
    b = load_bundle(path)
    assert isinstance(b, Bundle) and b.path == str(path)
    for name in bundle.TENSOR_ORDER[3:]:
        assert same_bits(getattr(b.problem, name), getattr(problem, name)), name
    assert same_bits(b.out, out) and same_bits(b.lse, lse) and same_bits(b.draft_logp, logp)
    nan = np.isnan(problem.kv_cache.astype(np.float64))
    assert nan.any() and (np.isnan(b.problem.kv_cache.astype(np.float64)) == nan).all()
    assert b.problem.scale == problem.scale and b.problem.kv_dtype == kv_dtype
    for key, value in make_meta().items():
        assert b.meta[key] == value, key
    assert b.meta["dims"] == {"B": B, "T": T, "H": H, "Dk": 576, "Dv": 512, "page_size": PAGE,
                              "num_pages": 6, "max_pages": 4}
    assert (b.name, b.out_dtype, b.kv_dtype, b.tree_family) == ("unit-b2-t5", "bf16", kv_dtype, "json")
    assert b.tolerances == make_meta()["tolerances"]
    assert digest == file_sha256(path)
    assert read_meta(path) == b.meta


def test_without_draft_logp(tmp_path):
    path = tmp_path / "a.kdtr"
    save(path, with_logp=False)
    b = load_bundle(path)
    assert b.draft_logp is None and "draft_logp" not in b.meta["checksums"]


def test_resave_of_loaded_bundle_is_identical(tmp_path):
    save(tmp_path / "a.kdtr")
    b = load_bundle(tmp_path / "a.kdtr")
    save_bundle(tmp_path / "b.kdtr", b.problem, b.out, b.lse, b.meta, draft_logp=b.draft_logp)
    assert (tmp_path / "a.kdtr").read_bytes() == (tmp_path / "b.kdtr").read_bytes()


@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16"])
def test_deterministic_bytes_and_alignment(tmp_path, kv_dtype):
    save(tmp_path / "a.kdtr", kv_dtype)
    save(tmp_path / "b.kdtr", kv_dtype)
    raw = (tmp_path / "a.kdtr").read_bytes()
    assert raw == (tmp_path / "b.kdtr").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert (8 + n) % 8 == 0 and raw[8:9] == b"{"
    header, _ = header_of(tmp_path / "a.kdtr")
    starts = {name: e["data_offsets"][0] for name, e in header.items() if name != "__metadata__"}
    for name, begin in starts.items():  # every tensor starts aligned to its item size
        assert begin % bundle.DTYPES[header[name]["dtype"]].itemsize == 0, name


def test_metadata_key_order_does_not_change_the_bytes(tmp_path):
    out, lse, logp = outputs()
    meta = make_meta(tree={"source": "unit", "family": "json"})
    backwards = dict(reversed(list(meta.items())))
    save_bundle(tmp_path / "a.kdtr", make_problem(), out, lse, meta, draft_logp=logp)
    save_bundle(tmp_path / "b.kdtr", make_problem(), out, lse, backwards, draft_logp=logp)
    assert (tmp_path / "a.kdtr").read_bytes() == (tmp_path / "b.kdtr").read_bytes()


def test_different_content_gives_different_bytes(tmp_path):
    save(tmp_path / "a.kdtr")
    save(tmp_path / "b.kdtr", seed=8)
    assert (tmp_path / "a.kdtr").read_bytes() != (tmp_path / "b.kdtr").read_bytes()


@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16"])
def test_safetensors_package_reads_it(tmp_path, kv_dtype):
    path = tmp_path / "a.kdtr"
    save(path, kv_dtype)
    b = load_bundle(path)
    items = dict(safetensors.deserialize(path.read_bytes()))
    assert set(items) == set(bundle.TENSOR_ORDER)
    store = "F32" if kv_dtype == "fp32" else "BF16"
    want = {"q": store, "kv_cache": store, "out": "F32", "lse": "F64", "draft_logp": "F64",
            "block_table": "I32", "prefix_lens": "I32", "tree_parent": "I32", "tree_depth": "I32",
            "tree_mask": "U32"}
    for name, info in items.items():
        arr = b.out if name == "out" else b.lse if name == "lse" else b.draft_logp if name == "draft_logp" \
            else getattr(b.problem, name)
        assert info["dtype"].upper() == want[name] and list(info["shape"]) == list(arr.shape), name
        assert bytes(info["data"]) == arr.tobytes(), name
    if kv_dtype == "fp32":
        with safe_open(str(path), framework="numpy") as f:
            assert json.loads(f.metadata()["kdtr"]) == b.meta
            assert set(f.keys()) == set(bundle.TENSOR_ORDER)
            assert same_bits(f.get_tensor("kv_cache"), b.problem.kv_cache)
            assert same_bits(f.get_tensor("tree_mask"), b.problem.tree_mask)


def test_read_meta_skips_the_data(tmp_path):
    path = tmp_path / "a.kdtr"
    save(path)
    header, data = header_of(path)
    begin = header["out"]["data_offsets"][0]
    data = bytearray(data)
    data[begin] ^= 0xFF
    write_header(path, header, bytes(data))
    assert read_meta(path)["case"] == "unit-b2-t5"
    expect_error(path, "checksum mismatch in tensor 'out'")
    assert load_bundle(path, verify_checksums=False).out.shape == (B, T, H, 512)


def test_out_is_stored_as_rounded_fp32_and_lse_widened_exactly(tmp_path):
    out, lse, logp = outputs()
    out64, lse32 = out.astype(np.float64) + 1e-12, lse.astype(np.float32)
    save_bundle(tmp_path / "a.kdtr", make_problem(), out64, lse32, make_meta(), draft_logp=logp)
    b = load_bundle(tmp_path / "a.kdtr")
    assert b.out.dtype == np.float32 and same_bits(b.out, out64.astype(np.float32))
    assert b.lse.dtype == np.float64 and same_bits(b.lse, lse32.astype(np.float64))


def test_bundle_error_pickles_and_takes_a_preformatted_message():
    e = pickle.loads(pickle.dumps(BundleError("x.kdtr", "bad\nthing")))
    assert str(e) == "x.kdtr: bad thing" and e.path == "x.kdtr" and e.problem == "bad thing"
    e = pickle.loads(pickle.dumps(BundleError("m.json: unreadable manifest")))
    assert str(e) == "m.json: unreadable manifest" and e.path is None


# ----------------------------------------------------------------------------- file-level failures


def test_missing_file_and_directory(tmp_path):
    expect_error(tmp_path / "nope.kdtr", "file not found")
    expect_error(tmp_path, "cannot read")
    with pytest.raises(BundleError, match="file not found"):
        read_meta(tmp_path / "nope.kdtr")
    with pytest.raises(BundleError, match="file not found"):
        file_sha256(tmp_path / "nope.kdtr")


@pytest.mark.parametrize("name", bundle.TENSOR_ORDER)
def test_flipped_bit_in_each_tensor_is_caught(tmp_path, name):
    path = tmp_path / "a.kdtr"
    save(path)
    raw = bytearray(path.read_bytes())
    header, _ = header_of(path)
    begin, end = header[name]["data_offsets"]
    start = len(raw) - len(header_of(path)[1])
    raw[start + (begin + end) // 2] ^= 0x01
    path.write_bytes(bytes(raw))
    expect_error(path, f"checksum mismatch in tensor {name!r}", "regenerate")


def test_truncation_at_many_points(tmp_path):
    path = tmp_path / "a.kdtr"
    save(path)
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    for cut in (0, 3, 7, 8, 9, 8 + n // 2, 8 + n - 1, 8 + n, 8 + n + 1, 8 + n + 100, len(raw) - 1):
        path.write_bytes(raw[:cut])
        expect_error(path, "truncated")


def test_appended_bytes_are_caught(tmp_path):
    path = tmp_path / "a.kdtr"
    save(path)
    path.write_bytes(path.read_bytes() + b"\0" * 8)
    expect_error(path, "8 trailing bytes")


@pytest.mark.parametrize("delta", [-8, -1, 1, 8])
def test_corrupt_header_length(tmp_path, delta):
    path = tmp_path / "a.kdtr"
    save(path)
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    path.write_bytes(struct.pack("<Q", n + delta) + raw[8:])
    msg = expect_error(path)
    assert any(s in msg for s in ("not valid JSON", "trailing bytes", "data region")), msg


@pytest.mark.parametrize("claim", [2**62, 2**64 - 1, 2**31])
def test_absurd_header_length(tmp_path, claim):
    path = tmp_path / "a.kdtr"
    save(path)
    path.write_bytes(struct.pack("<Q", claim) + path.read_bytes()[8:])
    expect_error(path, f"header length field claims {claim} bytes")


def test_absurd_tensor_size_claims_allocate_nothing(tmp_path):
    path = tmp_path / "a.kdtr"
    save(path)
    header, data = header_of(path)
    header["lse"]["shape"] = [2**40, 2**40, 2**40]
    write_header(path, header, data)
    tracemalloc.start()
    expect_error(path, "tensor 'lse': data_offsets span")
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 4 * path.stat().st_size + (1 << 20)
    header["lse"]["data_offsets"] = [0, 2**63]
    write_header(path, header, data)
    expect_error(path, "truncated: tensor 'lse' ends at data byte")


@pytest.mark.parametrize("content, problem", [
    (b"hello world, this is not a bundle", "header length field claims"),
    (struct.pack("<Q", 8) + b"[1,2,3] ", "not a kdtr bundle"),
    (struct.pack("<Q", 8) + b"{bad js ", "header is not valid JSON"),
    (struct.pack("<Q", 8) + b'{"\xff":1} ', "header is not valid JSON"),
    (struct.pack("<Q", 8) + b"{}      ", "not a kdtr bundle (no 'kdtr' metadata"),
    (struct.pack("<Q", 12000) + b"[" * 12000, "header is not valid JSON (maximum recursion depth"),
    (struct.pack("<Q", 8 + 6000) + b'{"a":' + b"9" * 6000 + b"}  ", "header is not valid JSON"),
])
def test_not_a_bundle(tmp_path, content, problem):
    path = tmp_path / "x.kdtr"
    path.write_bytes(content)
    expect_error(path, problem)


def test_plain_safetensors_file_is_not_a_bundle(tmp_path):
    path = tmp_path / "plain.safetensors"
    save_file({"x": np.zeros(3, np.float32)}, str(path), metadata={"other": "1"})
    expect_error(path, "not a kdtr bundle (no 'kdtr' metadata")


def test_duplicate_header_key(tmp_path):
    path = tmp_path / "a.kdtr"
    save(path)
    header, data = header_of(path)
    text = json.dumps(header)
    dup = text[:-1] + ', "lse": ' + json.dumps(header["lse"]) + "}"
    text = dup.encode() + b" " * (-(8 + len(dup)) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    expect_error(path, "repeated key 'lse'")


@pytest.mark.parametrize("fmt, problem", [("other", "format is 'other'"), (None, "format is None")])
def test_wrong_format(tmp_path, fmt, problem):
    path = tmp_path / "a.kdtr"
    save(path)
    edit_meta(path, lambda m: m.update(format=fmt))
    expect_error(path, "not a kdtr bundle", problem)


@pytest.mark.parametrize("version, shown", [(99, "99"), ("1", "'1'"), (True, "True"), (None, "None")])
def test_unsupported_version(tmp_path, version, shown):
    path = tmp_path / "a.kdtr"
    save(path)
    edit_meta(path, lambda m: m.update(version=version))
    expect_error(path, f"unsupported bundle version {shown}", "reads version 1")
    with pytest.raises(BundleError, match="unsupported bundle version"):
        read_meta(path)


def test_kdtr_metadata_not_json(tmp_path):
    path = tmp_path / "a.kdtr"
    save(path)
    header, data = header_of(path)
    header["__metadata__"] = bundle.metadata_strings("{nope")
    write_header(path, header, data)
    expect_error(path, "'kdtr' metadata is not valid JSON")


# ----------------------------------------------------------------------------- layout failures


def _edit_entry(path, fn):
    header, data = header_of(path)
    fn(header)
    write_header(path, header, data)


def test_unsupported_dtype(tmp_path):
    path = tmp_path / "a.kdtr"
    save(path)
    _edit_entry(path, lambda h: h["lse"].update(dtype="F16"))
    expect_error(path, "tensor 'lse': unsupported dtype 'F16'")


def test_overlapping_offsets(tmp_path):
    path = tmp_path / "a.kdtr"
    save(path)
    def shift(h):
        h["prefix_lens"]["data_offsets"] = [o - 4 for o in h["prefix_lens"]["data_offsets"]]
    _edit_entry(path, shift)
    expect_error(path, "overlap", "'prefix_lens'")


def test_gap_between_tensors(tmp_path):
    path = tmp_path / "a.kdtr"
    save(path)
    header, data = header_of(path)
    last = max((e["data_offsets"][1], n) for n, e in header.items() if n != "__metadata__")[1]
    header[last]["data_offsets"] = [o + 4 for o in header[last]["data_offsets"]]
    write_header(path, header, data + b"\0" * 4)
    expect_error(path, f"4 data bytes before tensor {last!r} belong to no tensor")


@pytest.mark.parametrize("entry, problem", [
    ({"dtype": "F64", "shape": [B, T, H], "data_offsets": [0, 8]}, "data_offsets span 8 bytes"),
    ({"dtype": "F64", "shape": [B, T, H], "data_offsets": [-8, 0]}, "two non-negative integers"),
    ({"dtype": "F64", "shape": [B, -T, H], "data_offsets": [0, 0]}, "shape must be a list"),
    ({"dtype": "F64", "shape": [B, T, H]}, "needs dtype, shape and data_offsets"),
    ([1, 2], "needs dtype, shape and data_offsets"),
])
def test_malformed_entry(tmp_path, entry, problem):
    path = tmp_path / "a.kdtr"
    save(path)
    _edit_entry(path, lambda h: h.update(lse=entry))
    expect_error(path, problem)


# ----------------------------------------------------------------------------- consistency failures


def test_missing_required_tensor(tmp_path):
    tensors, meta = good_parts(tmp_path)
    del tensors["lse"]
    write_raw(tmp_path / "x.kdtr", tensors, meta)
    expect_error(tmp_path / "x.kdtr", "missing required tensor 'lse'")


def test_checksum_entry_missing(tmp_path):
    path = tmp_path / "a.kdtr"
    save(path)
    edit_meta(path, lambda m: m["checksums"].pop("q"))
    expect_error(path, "checksums name")


@pytest.mark.parametrize("name, make, problem", [
    ("out", lambda a: a[:, :, :1].copy(), "tensor 'out' has shape [2, 5, 1, 512], expected [2, 5, 2, 512]"),
    ("out", lambda a: a.astype(np.float64), "tensor 'out' has dtype F64, expected F32"),
    ("lse", lambda a: a[:1].copy(), "tensor 'lse' has shape"),
    ("kv_cache", lambda a: a.astype(ml_dtypes.bfloat16), "q is F32 and kv_cache is BF16"),
    ("q", lambda a: a[:, :4].copy(), "tensor 'q' has shape"),
    ("tree_mask", lambda a: np.concatenate([a, a], axis=2), "tensor 'tree_mask' has shape [2, 5, 2]"),
    ("tree_mask", lambda a: a.astype(np.int32), "tensor 'tree_mask' has dtype I32, expected U32"),
    ("block_table", lambda a: a[:, :2].copy(), "tensor 'block_table' has shape"),
    ("prefix_lens", lambda a: a.astype(np.float64), "tensor 'prefix_lens' has dtype F64"),
    ("draft_logp", lambda a: a[0], "tensor 'draft_logp' has shape [15, 4], expected [2, L, K]"),
])
def test_inconsistent_tensors(tmp_path, name, make, problem):
    tensors, meta = good_parts(tmp_path)
    tensors[name] = make(tensors[name])
    write_raw(tmp_path / "x.kdtr", tensors, meta)
    expect_error(tmp_path / "x.kdtr", problem)


@pytest.mark.parametrize("edit, problem", [
    (lambda m: m["dims"].update(T=6), "tensor 'q' has shape [2, 5, 2, 576], expected [2, 6, 2, 576]"),
    (lambda m: m["dims"].update(Dk=192), "only Dk=576, Dv=512"),
    (lambda m: m["dims"].pop("max_pages"), "dims must give positive integers"),
    (lambda m: m["dims"].update(B=0), "dims must give positive integers"),
    (lambda m: m.update(kv_dtype="bf16"), "metadata kv_dtype 'bf16' but q/kv_cache are F32"),
    (lambda m: m.update(out_dtype="fp16"), "out_dtype must be 'fp32' or 'bf16'"),
    (lambda m: m.update(scale=-1.0), "metadata scale must be a positive finite number"),
    (lambda m: m.update(tree={"params": {}}), "tree must be an object with a string 'family'"),
    (lambda m: m.update(tolerances=[1]), "tolerances must be a JSON object"),
    (lambda m: m.update(tolerances={"out": {"atol": float("inf")}}), "tolerances out.atol must be a finite number"),
    (lambda m: m.update(tolerances={"out": {"atol": "0.1"}}), "tolerances out.atol must be a finite number, got '0.1'"),
    (lambda m: m.update(tolerances={"out": {"atol": True}}), "tolerances out.atol must be a finite number"),
    (lambda m: m.update(tolerances={"lse": {"min_cos": 2}}), "tolerances lse out of range"),
    (lambda m: m.update(tolerances={"lse": {"rtol": -1e-3}}), "tolerances lse out of range"),
    (lambda m: m.update(tolerances={"outt": {}}), "tolerances name an unknown output 'outt'"),
    (lambda m: m.update(tolerances={"out": {"abs": 1}}), "tolerances out.abs is not a tolerance"),
    (lambda m: m.update(tolerances={"out": 1e-3}), "tolerances out must be a JSON object"),
    (lambda m: m.update(conditioning={"max_abs_score": float("inf")}), "conditioning max_abs_score must be a finite"),
    (lambda m: m.update(conditioning={"max_abs_score": float("nan")}), "conditioning max_abs_score must be a finite"),
    (lambda m: m.update(conditioning={"max_abs_score": -1.0}), "conditioning max_abs_score must be a finite number >= 0"),
    (lambda m: m.update(conditioning={"max_abs_score": "9"}), "conditioning max_abs_score must be a finite"),
    (lambda m: m.update(conditioning={"max_abs_score": True}), "conditioning max_abs_score must be a finite"),
    (lambda m: m.update(conditioning={"max_abs_score": 9.0, "v": 1}), "conditioning must be a JSON object with max_abs"),
    (lambda m: m.update(conditioning=[9.0]), "conditioning must be a JSON object with max_abs_score alone"),
    (lambda m: m.update(seed="7"), "seed must be an integer"),
    (lambda m: m.pop("spec"), "metadata lacks spec"),
])
def test_inconsistent_metadata(tmp_path, edit, problem):
    path = tmp_path / "a.kdtr"
    save(path)
    edit_meta(path, edit)
    expect_error(path, problem)


def test_problem_validate_failure(tmp_path):
    tensors, meta = good_parts(tmp_path)
    tensors["block_table"][1, 0] = 99
    write_raw(tmp_path / "x.kdtr", tensors, meta)
    expect_error(tmp_path / "x.kdtr", "inconsistent inputs: block_table points outside kv_cache")


def test_non_tree_parents(tmp_path):
    tensors, meta = good_parts(tmp_path)
    tensors["tree_parent"][1] = [-1, 0, 3, 1, 2]  # node 2's parent comes after it
    write_raw(tmp_path / "x.kdtr", tensors, meta)
    expect_error(tmp_path / "x.kdtr", "request 1: bad tree", "node 2 has parent 3")


def test_mask_disagreeing_with_parents(tmp_path):
    tensors, meta = good_parts(tmp_path)
    tensors["tree_mask"][1, 3, 0] |= np.uint32(1 << 2)  # node 3 (child of 1) also sees sibling 2
    write_raw(tmp_path / "x.kdtr", tensors, meta)
    expect_error(tmp_path / "x.kdtr", "request 1: bad tree", "mask row 3 disagrees", "extra bits [2]")


def test_depth_disagreeing_with_parents(tmp_path):
    tensors, meta = good_parts(tmp_path)
    tensors["tree_depth"][0, 4] = 7
    write_raw(tmp_path / "x.kdtr", tensors, meta)
    expect_error(tmp_path / "x.kdtr", "request 0: bad tree", "depth[4] = 7")


def test_numpy_refusal_becomes_bundle_error(tmp_path):
    """A zero-size tensor may claim any shape; numpy's refusal still surfaces as BundleError."""
    tensors, meta = good_parts(tmp_path)
    tensors["draft_logp"] = np.zeros((B, 0, 4))
    write_raw(tmp_path / "x.kdtr", tensors, meta)
    load_bundle(tmp_path / "x.kdtr")
    header, data = header_of(tmp_path / "x.kdtr")
    header["draft_logp"]["shape"] = [B, 2**70, 0]
    write_header(tmp_path / "x.kdtr", header, data)
    expect_error(tmp_path / "x.kdtr", "malformed bundle (ValueError")


def test_raw_writer_makes_loadable_files(tmp_path):
    """The helper behind the failure tests is faithful: unedited parts load fine."""
    tensors, meta = good_parts(tmp_path)
    write_raw(tmp_path / "x.kdtr", tensors, meta)
    assert load_bundle(tmp_path / "x.kdtr").meta == meta


def test_header_mutations_only_raise_bundle_error(tmp_path):
    path = tmp_path / "a.kdtr"
    save(path)
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    s = Stream(3, "fuzz")
    where, what = s.integers(300, 8 + n), s.integers(300, 256)
    failures = 0
    for pos, val in zip(where.tolist(), what.tolist()):
        mutated = bytearray(raw)
        mutated[pos] = val
        path.write_bytes(bytes(mutated))
        try:
            load_bundle(path)
        except BundleError as e:
            failures += 1
            assert str(e).startswith(f"{path}: ") and "\n" not in str(e)
    assert failures > 200


# ----------------------------------------------------------------------------- saving


def test_save_validates_first(tmp_path):
    path = tmp_path / "a.kdtr"
    problem = make_problem()
    out, lse, logp = outputs()
    with pytest.raises(ValueError, match="tensor 'out' has shape"):
        save_bundle(path, problem, out[:, :, :1], lse, make_meta())
    with pytest.raises(ValueError, match="tensor 'lse' has dtype I32"):
        save_bundle(path, problem, out, lse.astype(np.int32), make_meta())
    with pytest.raises(ValueError, match="metadata lacks case"):
        save_bundle(path, problem, out, lse, {k: v for k, v in make_meta().items() if k != "case"})
    with pytest.raises(ValueError, match="tree"):
        bad = make_problem()
        bad.tree_parent[0, 1] = 3
        save_bundle(path, bad, out, lse, make_meta())
    with pytest.raises(ValueError, match="block_table"):
        bad = make_problem()
        bad.block_table = bad.block_table[:, :1].copy()
        save_bundle(path, bad, out, lse, make_meta())
    assert list(tmp_path.iterdir()) == []


def test_save_ignores_caller_values_it_computes(tmp_path):
    out, lse, _ = outputs()
    meta = make_meta(scale=9.0, version=5, checksums={}, kv_dtype="bf16", dims={"B": 9, "note": "kept"})
    save_bundle(tmp_path / "a.kdtr", make_problem(), out, lse, meta)
    meta = load_bundle(tmp_path / "a.kdtr").meta
    assert (meta["scale"], meta["version"], meta["kv_dtype"]) == (0.1352, 1, "fp32")
    assert meta["dims"]["B"] == B and meta["dims"]["note"] == "kept"
    assert set(meta["checksums"]) == set(bundle_header.REQUIRED)


def test_failed_write_leaves_no_file(tmp_path, monkeypatch):
    calls = []
    real_raw = bundle._raw

    def failing_raw(a):
        calls.append(a.shape)
        if len(calls) > len(bundle.TENSOR_ORDER) + 3:  # checksums done, header + 3 tensors written
            raise OSError("disk full")
        return real_raw(a)

    monkeypatch.setattr(bundle, "_raw", failing_raw)
    with pytest.raises(OSError, match="disk full"):
        save(tmp_path / "a.kdtr")
    assert list(tmp_path.iterdir()) == []


def test_failed_fsync_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "a.kdtr"
    save(path)
    before = path.read_bytes()

    def no_fsync(fd):
        raise OSError("fsync failed")

    monkeypatch.setattr(bundle.os, "fsync", no_fsync)
    with pytest.raises(OSError, match="fsync failed"):
        save(path, seed=99)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["a.kdtr"]


def test_atomic_writer(tmp_path):
    path = tmp_path / "m.json"
    atomic_write_bytes(path, b"v1")
    with pytest.raises(KeyboardInterrupt):
        with atomic_writer(path) as f:
            f.write(b"half")
            raise KeyboardInterrupt
    assert path.read_bytes() == b"v1" and os.listdir(tmp_path) == ["m.json"]
    with atomic_writer(path, text=True) as f:
        f.write("v2\n")
    assert path.read_bytes() == b"v2\n" and os.listdir(tmp_path) == ["m.json"]
    mode = os.stat(path).st_mode & 0o777
    umask = os.umask(0)
    os.umask(umask)
    assert mode == 0o666 & ~umask


def test_staged_write_then_publish(tmp_path):
    """save_bundle(atomic=False) onto a temp_path, then publish: how kdtr gen installs bundles."""
    final = tmp_path / "a.kdtr"
    staged = atomic.temp_path(final)
    assert os.path.dirname(staged) == str(tmp_path) and atomic.TEMP_NAME.match(os.path.basename(staged))
    assert not staged.endswith(".kdtr")
    sha = save(staged)
    assert sha == file_sha256(staged) and not final.exists()
    with pytest.raises(FileExistsError):  # atomic=False never overwrites
        out, lse, logp = outputs()
        save_bundle(staged, make_problem(), out, lse, make_meta(), atomic=False)
    atomic.publish(staged, final)
    assert os.listdir(tmp_path) == ["a.kdtr"] and file_sha256(final) == sha
    load_bundle(final)


def test_bundle_error_text_is_capped():
    e = BundleError("x.kdtr", "tensor " + "n" * 5000 + " is odd")
    assert len(e.problem) == bundle.MAX_PROBLEM and e.problem.endswith("...")
    assert pickle.loads(pickle.dumps(e)).problem == e.problem


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="needs Linux /proc")
def test_stale_temps_of_zombie_or_reused_pids_are_removed(tmp_path):
    """A killed gen's pool workers stay zombies where PID 1 does not reap them, and pids are reused:
    neither may keep a dead writer's temporary file forever; a live writer's file is kept."""
    zombie = subprocess.Popen(["true"])
    deadline = time.time() + 5
    while atomic._linux_start_time(zombie.pid) != "zombie" and time.time() < deadline:
        time.sleep(0.05)
    later = subprocess.Popen(["sleep", "30"])  # a live process that started after the files below
    try:
        old = time.time() - 60
        files = {pid: tmp_path / f".case.kdtr.{pid}.0123abcd.tmp" for pid in (zombie.pid, later.pid, os.getpid())}
        for path in files.values():
            path.write_bytes(b"partial")
            os.utime(path, (old, old))
        removed = atomic.remove_stale_temps(tmp_path)
        assert removed == sorted(files[pid].name for pid in (zombie.pid, later.pid))
        assert files[os.getpid()].exists()
        fresh = tmp_path / f".case.kdtr.{later.pid}.0123abcd.tmp"  # written by `later` while it runs: kept
        fresh.write_bytes(b"partial")
        assert atomic.remove_stale_temps(tmp_path) == [] and fresh.exists()
    finally:
        zombie.wait()
        later.kill()
        later.wait()
