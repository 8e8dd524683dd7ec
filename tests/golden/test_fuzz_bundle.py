"""Fuzzed bundle loading (issue 6): no bytes on disk can make load_bundle misbehave.

The property, for every mutation of a real bundle below: ``load_bundle`` either raises
``BundleError`` (one line, "<path>: <problem>") or returns a bundle whose arrays and metadata are
exactly what was written (or, for a re-signed metadata edit, exactly what the edit says); it never
raises anything else, and its peak allocation (tracemalloc) stays within twice the file's size
plus 1 MiB. Hypothesis draws the random cases (about 300 examples in all); truncation and
single-bit flips in the header are tried exhaustively.
"""

from __future__ import annotations

import json
import os
import struct
import time
import tracemalloc
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kdtr.golden import bundle, format as bundle_header
from kdtr.golden.bundle import Bundle, BundleError, load_bundle, read_meta, save_bundle
from kdtr.inputs.cases import CaseSpec
from kdtr.golden.generate import build_bundle

SPEC = CaseSpec(heads=1, prefix_lens=(0, 2), budget=3, page_size=2)
"""B = 2, T = 4, a DDTree case (so draft_logp is present), paged, bf16: every tensor kind."""
SLACK = 1 << 20


def fuzz(examples: int) -> settings:
    """Hypothesis settings of one property (the file draws about 300 examples in all)."""
    return settings(max_examples=examples, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


ARRAYS = ("q", "kv_cache", "block_table", "prefix_lens", "tree_parent", "tree_depth", "tree_mask")


@dataclass
class Golden:
    raw: bytes
    """The bundle file as written."""
    n: int
    """Header length (the JSON starts at 8, the data at 8 + n)."""
    header: dict
    """The parsed header."""
    bundle: Bundle
    """What loading the intact file gives."""
    work: Path
    """Scratch file the tests write mutations to."""

    @property
    def data_start(self) -> int:
        return 8 + self.n

    def tensor_at(self, pos: int) -> str:
        """Name of the tensor holding file byte ``pos`` (in the data region)."""
        off = pos - self.data_start
        return next(name for name, e in self.header.items()
                    if name != "__metadata__" and e["data_offsets"][0] <= off < e["data_offsets"][1])


@pytest.fixture(scope="module")
def golden(tmp_path_factory) -> Golden:
    folder = tmp_path_factory.mktemp("fuzz")
    b = build_bundle(SPEC)
    path = folder / "good.kdtr"
    save_bundle(path, b.problem, b.out, b.lse, b.meta, draft_logp=b.draft_logp)
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return Golden(raw, n, json.loads(raw[8 : 8 + n]), load_bundle(path), folder / "x.kdtr")


def measured_load(path) -> tuple[Bundle | BundleError, int]:
    """(the bundle or the BundleError, peak bytes allocated while loading); other errors propagate."""
    tracemalloc.start()
    try:
        result = load_bundle(path)
    except BundleError as e:
        result = e
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return result, peak


def attempt(path: Path, data: bytes) -> Bundle | BundleError:
    """Write ``data`` to ``path``, load it, and check the invariants every outcome must meet.

    Also read_meta: it must agree with load_bundle (it may pass where only the data is bad).
    """
    path.write_bytes(data)
    result, peak = measured_load(path)
    assert peak <= 2 * len(data) + SLACK, f"loading a {len(data)}-byte file allocated {peak} bytes"
    try:
        meta = read_meta(path)
    except BundleError as e:
        meta = e
    for outcome in (result, meta):
        if isinstance(outcome, BundleError):
            msg = str(outcome)
            assert msg.startswith(f"{path}: ") and "\n" not in msg, msg
            assert len(msg) <= len(f"{path}: ") + bundle.MAX_PROBLEM, msg
    if isinstance(result, Bundle):
        assert meta == result.meta
    return result


def same_arrays(got: Bundle, want: Bundle) -> bool:
    """Every tensor bit-identical (dtype, shape and bytes)."""
    def same(a, b):
        return (a is None and b is None) or (a is not None and b is not None and a.dtype == b.dtype
                                             and a.shape == b.shape and a.tobytes() == b.tobytes())

    return (all(same(getattr(got.problem, n), getattr(want.problem, n)) for n in ARRAYS)
            and same(got.out, want.out) and same(got.lse, want.lse) and same(got.draft_logp, want.draft_logp))


def same_bundle(got: Bundle, want: Bundle) -> bool:
    return same_arrays(got, want) and got.problem.scale == want.problem.scale and got.meta == want.meta


def only_benign_changes(g: Golden, mutated: bytes) -> bool:
    """The bytes that differ lie in the kdtr_sha256 key and its value, or are padding turned whitespace.

    With the key's name changed the checksum is just an unknown key (as in bundles written before
    it existed); any other change to the header or the data is caught.
    """
    key = g.raw.index(b'"' + bundle.META_SHA_KEY.encode() + b'":"')
    sha_span = range(key, key + len(bundle.META_SHA_KEY) + 4 + 64 + 1)
    pad = range(8 + len(g.raw[8 : g.data_start].rstrip(b" ")), g.data_start)
    changed = [i for i in range(len(mutated)) if mutated[i] != g.raw[i]]
    return len(mutated) == len(g.raw) and all(i in sha_span or (i in pad and mutated[i] in b" \t\r\n")
                                                 for i in changed)


def encode(header: dict, data: bytes) -> bytes:
    """A file from a header object and a data region, with a correct length prefix."""
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)
    return struct.pack("<Q", len(text)) + text + data


def copy_header(g: Golden) -> dict:
    return json.loads(json.dumps(g.header))


def data_of(g: Golden) -> bytes:
    return g.raw[g.data_start :]


def expect_error(result, *fragments) -> str:
    assert isinstance(result, BundleError), "a mutated bundle loaded"
    for frag in fragments:
        assert frag in str(result), str(result)
    return str(result)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5),
    max_leaves=12,
)
"""Any JSON value (what a hostile or corrupted header may hold where kdtr expects something else)."""


# ----------------------------------------------------------------------------- the intact file


def test_the_intact_file_loads_within_the_memory_bound(golden):
    result = attempt(golden.work, golden.raw)
    assert isinstance(result, Bundle) and same_bundle(result, golden.bundle)


# ----------------------------------------------------------------------------- random bytes


@fuzz(40)
@given(st.binary(max_size=4096))
def test_random_bytes(golden, data):
    expect_error(attempt(golden.work, data))


@fuzz(30)
@given(st.integers(0, 6000), st.binary(max_size=6000), st.sampled_from([b"", b"{", b'{"__metadata__":']))
def test_random_bytes_behind_a_plausible_length(golden, n, body, start):
    expect_error(attempt(golden.work, struct.pack("<Q", n) + start + body))


# ----------------------------------------------------------------------------- truncation


def test_truncation_at_every_header_boundary(golden):
    """Every cut in the length prefix and the JSON, and at each tensor's begin and end, +-1."""
    cuts = set(range(0, golden.data_start + 2))
    for name, e in golden.header.items():
        if name != "__metadata__":
            for off in e["data_offsets"]:
                cuts |= {golden.data_start + off + d for d in (-1, 0, 1)}
    cuts |= set(range(golden.data_start, len(golden.raw), 997))
    cuts = sorted(c for c in cuts if 0 <= c < len(golden.raw))
    assert len(cuts) > golden.n
    for cut in cuts:
        expect_error(attempt(golden.work, golden.raw[:cut]), "truncated")


def test_appended_bytes(golden):
    for extra in (b"\0", b" " * 8, golden.raw[-64:]):
        expect_error(attempt(golden.work, golden.raw + extra), "trailing bytes")


# ----------------------------------------------------------------------------- bit flips


def test_every_single_bit_flip_in_the_header(golden):
    """All 8 * (8 + n) flips of the length prefix and the JSON header.

    Each is refused, except flips inside the name of the kdtr_sha256 key: they turn the
    metadata checksum into an unknown key (bundles written before it existed lack it too), and
    the bundle then loads exactly as written — one flip cannot both disable the check and
    change what it guards.
    """
    path = golden.work
    path.write_bytes(golden.raw)
    key = golden.raw.index(b'"' + bundle.META_SHA_KEY.encode() + b'"')
    benign_zone = range(key + 1, key + 1 + len(bundle.META_SHA_KEY))
    loaded, refused = [], 0
    fd = os.open(path, os.O_RDWR)
    try:
        for pos in range(golden.data_start):
            for bit in range(8):
                os.pwrite(fd, bytes([golden.raw[pos] ^ (1 << bit)]), pos)
                try:
                    b = load_bundle(path)
                except BundleError:
                    refused += 1
                else:
                    assert pos in benign_zone, f"flip of bit {bit} at byte {pos} loaded"
                    assert same_bundle(b, golden.bundle)
                    loaded.append(pos)
            os.pwrite(fd, golden.raw[pos : pos + 1], pos)
    finally:
        os.close(fd)
    assert refused + len(loaded) == 8 * golden.data_start
    assert set(loaded) == set(benign_zone)  # every character of the key name has such a flip


@fuzz(30)
@given(st.data())
def test_bit_flip_in_the_data_names_the_tensor(golden, data):
    pos = data.draw(st.integers(golden.data_start, len(golden.raw) - 1))
    bit = data.draw(st.integers(0, 7))
    raw = bytearray(golden.raw)
    raw[pos] ^= 1 << bit
    expect_error(attempt(golden.work, bytes(raw)), f"checksum mismatch in tensor {golden.tensor_at(pos)!r}")


@fuzz(40)
@given(st.data())
def test_several_bit_flips_anywhere(golden, data):
    """2..6 flips, half of them in the header: refused unless they cancel out or hit the key name."""
    k = data.draw(st.integers(2, 6))
    in_header = st.integers(0, golden.data_start - 1)
    anywhere = st.integers(0, len(golden.raw) - 1)
    spots = [data.draw(in_header if i % 2 == 0 else anywhere) for i in range(k)]
    raw = bytearray(golden.raw)
    for pos in spots:
        raw[pos] ^= 1 << data.draw(st.integers(0, 7))
    result = attempt(golden.work, bytes(raw))
    if isinstance(result, Bundle):
        assert only_benign_changes(golden, bytes(raw)) and same_bundle(result, golden.bundle)


@fuzz(30)
@given(st.lists(st.tuples(st.integers(0, 1 << 30), st.integers(0, 255)), min_size=1, max_size=4))
def test_byte_replacements(golden, edits):
    raw = bytearray(golden.raw)
    for pos, value in edits:
        raw[pos % golden.data_start if pos & 1 else pos % len(raw)] = value
    result = attempt(golden.work, bytes(raw))
    if isinstance(result, Bundle):  # e.g. a padding space replaced by another JSON whitespace
        assert only_benign_changes(golden, bytes(raw)) and same_bundle(result, golden.bundle)


def test_padding_turned_whitespace_is_benign(golden):
    """The one edit of the header JSON that changes nothing: padding is JSON whitespace."""
    raw = bytearray(golden.raw)
    raw[golden.data_start - 1] = ord("\n")
    result = attempt(golden.work, bytes(raw))
    assert only_benign_changes(golden, bytes(raw)) and same_bundle(result, golden.bundle)
    assert not only_benign_changes(golden, golden.raw[:-1] + b"x")


# ----------------------------------------------------------------------------- lying headers


@fuzz(40)
@given(st.data())
def test_lying_tensor_entries(golden, data):
    """Wrong shapes, offsets or dtypes (any JSON value) under a correct length prefix."""
    header = copy_header(golden)
    name = data.draw(st.sampled_from(sorted(n for n in header if n != "__metadata__")))
    field = data.draw(st.sampled_from(["shape", "data_offsets", "dtype", "whole", "missing"]))
    entry = header[name]
    if field == "missing":
        del header[name]
    elif field == "whole":
        header[name] = data.draw(json_values)
        assume(header[name] != entry)
    else:
        old = entry[field]
        lies = {
            "shape": st.lists(st.integers(0, 2**64), max_size=6) | st.permutations(old) | json_values,
            "data_offsets": st.lists(st.integers(-4, 2**64), min_size=2, max_size=2)
            | st.tuples(st.integers(-64, 64), st.integers(-64, 64)).map(lambda d: [old[0] + d[0], old[1] + d[1]])
            | json_values,
            "dtype": st.sampled_from(sorted(bundle.DTYPES) + ["F16", "I64", "bf16", ""]) | json_values,
        }
        entry[field] = data.draw(lies[field])
        assume(entry[field] != old)
    expect_error(attempt(golden.work, encode(header, data_of(golden))))


def test_transposed_draft_logp_is_refused(golden):
    """Found by test_lying_tensor_entries: [B, L, K] relabelled [B, K, L] keeps its bytes, hence its
    checksum, and draft_logp's L and K are free; only rebuilding the DDTree tree catches it."""
    header = copy_header(golden)
    shape = header["draft_logp"]["shape"]
    assert shape[1] != shape[2]
    header["draft_logp"]["shape"] = [shape[0], shape[2], shape[1]]
    expect_error(attempt(golden.work, encode(header, data_of(golden))), "draft_logp")


@fuzz(30)
@given(st.data())
def test_lying_dims_even_when_re_signed(golden, data):
    """A dims lie in correctly re-signed metadata still disagrees with the tensors."""
    header = copy_header(golden)
    meta = json.loads(header["__metadata__"][bundle.META_KEY])
    key = data.draw(st.sampled_from(bundle_header.DIM_KEYS))
    meta["dims"][key] = data.draw(st.integers(-2, 2**63) | json_values)
    assume(meta["dims"][key] != golden.bundle.meta["dims"][key])
    header["__metadata__"] = bundle.metadata_strings(json.dumps(meta))
    expect_error(attempt(golden.work, encode(header, data_of(golden))))


@fuzz(40)
@given(st.data())
def test_re_signed_metadata_edits_load_as_written_or_are_refused(golden, data):
    """Any value in any metadata field: refused, or loaded with exactly that metadata."""
    header = copy_header(golden)
    meta = json.loads(header["__metadata__"][bundle.META_KEY])
    key = data.draw(st.sampled_from(sorted(meta) + ["unknown_key"]))
    meta[key] = data.draw(json_values)
    assume(meta != golden.bundle.meta)
    header["__metadata__"] = bundle.metadata_strings(json.dumps(meta))
    result = attempt(golden.work, encode(header, data_of(golden)))
    if isinstance(result, Bundle):
        assert key not in ("format", "version", "dims", "checksums", "kv_dtype"), key
        want = json.loads(json.dumps(meta))
        assert same_arrays(result, golden.bundle) and result.meta == want
        assert result.problem.scale == float(want["scale"])


def test_unsigned_metadata_edits_are_caught(golden):
    """Widening a tolerance or nudging the scale without re-signing: the checksum catches it."""
    for old, new in ((b'\\"atol\\":0.004', b'\\"atol\\":0.400'), (b'\\"scale\\":0.1352', b'\\"scale\\":0.1353'),
                     (b'\\"seed\\":0', b'\\"seed\\":1')):
        assert golden.raw.count(old) >= 1, old
        raw = golden.raw.replace(old, new, 1)
        expect_error(attempt(golden.work, raw), "metadata checksum mismatch")
        with pytest.raises(BundleError, match="metadata checksum mismatch"):
            read_meta(golden.work)


def test_bundles_without_the_metadata_checksum_still_load(golden):
    """Bundles written before kdtr recorded kdtr_sha256 (the committed ci goldens) stay readable."""
    header = copy_header(golden)
    del header["__metadata__"][bundle.META_SHA_KEY]
    result = attempt(golden.work, encode(header, data_of(golden)))
    assert isinstance(result, Bundle) and same_bundle(result, golden.bundle)


# ----------------------------------------------------------------------------- absurd sizes


@pytest.mark.parametrize("claim", [2**63 - 1, 2**64 - 1, 2**32, "size - 7"])
def test_absurd_header_length(golden, claim):
    n = len(golden.raw) - 7 if claim == "size - 7" else claim
    expect_error(attempt(golden.work, struct.pack("<Q", n) + golden.raw[8:]), "header length field claims")


@pytest.mark.parametrize("name, entry, problem", [
    ("lse", {"shape": [2**40, 2**40, 2**40]}, "data_offsets span"),
    ("lse", {"shape": [2**62] * 500}, "data_offsets span"),
    ("lse", {"shape": [2**40, 0], "data_offsets": [0, 0]}, ""),
    ("kv_cache", {"shape": [2**40, 2, 576]}, "needs more than the"),
    ("q", {"data_offsets": [0, 2**63 - 1]}, "truncated: tensor 'q' ends at data byte"),
    ("q", {"data_offsets": [2**64, 2**64 + 2]}, "truncated"),
    ("out", {"shape": [2**40, 2**40], "data_offsets": [0, 2**80 * 4]}, "truncated"),
])
def test_absurd_tensor_sizes(golden, name, entry, problem):
    header = copy_header(golden)
    header[name].update(entry)
    t0 = time.perf_counter()
    expect_error(attempt(golden.work, encode(header, data_of(golden))), problem)
    assert time.perf_counter() - t0 < 2.0


def test_absurd_dims_in_re_signed_metadata(golden):
    header = copy_header(golden)
    meta = json.loads(header["__metadata__"][bundle.META_KEY])
    meta["dims"].update(B=2**40, T=2**40, num_pages=2**62)
    header["__metadata__"] = bundle.metadata_strings(json.dumps(meta))
    expect_error(attempt(golden.work, encode(header, data_of(golden))), "has shape")


# ----------------------------------------------------------------------------- regressions the fuzzing found


HOSTILE = {  # (opening, repeated unit, closing): JSON that is cheap to write and costly to parse
    "empty dicts": ("[", "{},", "{}]"),
    "empty lists": ("[", "[],", "[]]"),
    "short strings": ("[", '"ab",', '"ab"]'),
    "floats": ("[", "1e0,", "1]"),
    "one-key dicts": ("[", '{"a":0},', "{}]"),
    "astral escape widening a string": ('"\\ud83d\\ude00', "x", '"'),
    "many keys": ("{", None, '"z":0}'),
}


@pytest.mark.parametrize("data_len", [0, 1 << 20])
@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_hostile_json_header_stays_within_the_file_size(golden, kind, data_len):
    """Regression: a header of tiny JSON values cost ~25x its size in Python objects.

    Headers are now limited to bundle_header.header_limit(data bytes): at that limit the costliest JSON
    stays within the memory bound, and one byte more is refused before parsing.
    """
    limit = bundle_header.header_limit(data_len)
    opening, unit, closing = HOSTILE[kind]
    room = limit - len('{"x":}') - len(opening) - len(closing)
    body = "".join(f'"{i:07d}":0,' for i in range(room // 12)) if unit is None else unit * (room // len(unit))
    text = ('{"x":' + opening + body + closing + "}").encode()
    assert limit - 12 <= len(text) <= limit
    text += b" " * (limit - len(text))
    data = b"\0" * data_len
    msg = expect_error(attempt(golden.work, struct.pack("<Q", limit) + text + data), "not a kdtr bundle")
    assert "a kdtr header is at most" not in msg
    if unit is not None:  # 16x the limit: parsing it would cost far more than the file's size
        big = ('{"x":' + opening + unit * (16 * room // len(unit)) + closing + "}").encode()
        expect_error(attempt(golden.work, struct.pack("<Q", len(big)) + big + data), "a kdtr header is at most")
    expect_error(attempt(golden.work, struct.pack("<Q", limit + 1) + text + b" " + data), "a kdtr header is at most")


def test_real_headers_are_far_below_the_limit(golden, tmp_path):
    """The limit never refuses a real bundle: even 400 one-token requests leave a wide margin."""
    assert golden.n < bundle_header.HEADER_BASE // 4
    many = CaseSpec(heads=1, prefix_lens=(0,) * 400, family="root", budget=0, page_size=1)
    b = build_bundle(many)
    save_bundle(tmp_path / "many.kdtr", b.problem, b.out, b.lse, b.meta)
    raw = (tmp_path / "many.kdtr").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert n > golden.n + 400 and 4 * n < bundle_header.header_limit(len(raw) - 8 - n)  # grows with B, stays far below
    assert load_bundle(tmp_path / "many.kdtr").problem.B == 400


def test_repeated_key_found_in_linear_time():
    """Regression: finding the repeated key was quadratic (a hostile header with many keys hung)."""
    pairs = [(f"k{i}", 0) for i in range(40000)] + [("k39999", 1)]
    t0 = time.perf_counter()
    with pytest.raises(bundle_header.Invalid, match="repeated key 'k39999'"):
        bundle_header._no_duplicates(pairs)
    assert time.perf_counter() - t0 < 0.5
    assert bundle_header._no_duplicates([("a", 1), ("b", 2)]) == {"a": 1, "b": 2}


def test_unhashable_dtype_is_a_clean_error(golden):
    """Regression: a list as dtype surfaced as "malformed bundle (TypeError: unhashable type...)"."""
    header = copy_header(golden)
    header["lse"]["dtype"] = ["F64"]
    expect_error(attempt(golden.work, encode(header, data_of(golden))), "tensor 'lse': unsupported dtype ['F64']")


def test_memory_bound_is_not_vacuous(golden, monkeypatch):
    """tracemalloc sees numpy's buffers: a loader copying every tensor shows up in the peak."""
    golden.work.write_bytes(golden.raw)
    _, lean = measured_load(golden.work)
    real = np.frombuffer
    monkeypatch.setattr(bundle.np, "frombuffer", lambda *a, **k: real(*a, **k).copy())
    result, copying = measured_load(golden.work)
    data_len = len(golden.raw) - golden.data_start
    assert isinstance(result, Bundle)
    assert copying >= 2 * data_len and copying - lean > data_len // 2, (lean, copying)
