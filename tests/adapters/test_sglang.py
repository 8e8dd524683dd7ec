"""kdtr.adapters.sglang against SGLang's target-verify formulas, recomputed here from the tree's
parents and the block table (not from the adapter's own helpers), and an SGLang-layout Python
kernel verified by `kdtr verify` on committed goldens."""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest

from conftest import GOLDENS_CI
from kdtr.adapters.sglang import SglangBatch, from_sglang, to_sglang
from kdtr.inputs.cases import CaseSpec, build_problem
from kdtr.inputs.problem import Problem

KERNELS = Path(__file__).resolve().parent / "sglang_kernels.py"
PROBLEM_ARRAYS = ("q", "kv_cache", "block_table", "prefix_lens", "tree_parent", "tree_depth", "tree_mask")
MIXED = (0, 1, 63, 64, 65, 130)
"""Prefix lengths around a 64-token page edge, with P = 0."""


def problem(page_size: int, budget: int = 20, prefix_lens=MIXED, kv_dtype="bf16") -> Problem:
    return build_problem(CaseSpec(heads=2, prefix_lens=prefix_lens, budget=budget, page_size=page_size,
                                  kv_dtype=kv_dtype))[0]


def same(a: np.ndarray, b: np.ndarray) -> bool:
    """Identical shape, dtype and bytes (NaN slots included)."""
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def sees(parent: np.ndarray, t: int, c: int) -> bool:
    """Node c is node t or one of its ancestors (walking the parent links)."""
    while t != -1:
        if t == c:
            return True
        t = int(parent[t])
    return False


@pytest.mark.parametrize("bitpacked", [False, True], ids=["full", "bitpacked"])
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp32"])
def test_page_size_1_round_trip_is_identical(bitpacked, kv_dtype):
    p = problem(1, kv_dtype=kv_dtype)
    back = from_sglang(to_sglang(p, bitpacked), p.T, p.H)
    for name in PROBLEM_ARRAYS:
        assert same(getattr(back, name), getattr(p, name)), name
    assert back.scale == p.scale


@pytest.mark.parametrize("bitpacked", [False, True], ids=["full", "bitpacked"])
def test_page_size_64_becomes_the_same_tokens_on_a_token_pool(bitpacked):
    p = problem(64)
    s = to_sglang(p, bitpacked)
    back = from_sglang(s, p.T, p.H)
    assert back.page_size == 1
    for name in ("q", "prefix_lens", "tree_parent", "tree_depth", "tree_mask"):
        assert same(getattr(back, name), getattr(p, name)), name
    for b in range(p.B):
        n = int(p.prefix_lens[b]) + p.T
        assert same(back.gather_kv(b, 0, n), p.gather_kv(b, 0, n)), b
    again = to_sglang(back, bitpacked)
    for f in fields(SglangBatch):
        x, y = getattr(again, f.name), getattr(s, f.name)
        assert same(x, y) if isinstance(x, np.ndarray) else x == y, f.name


def test_pool_slots_indptrs_and_block_table_follow_sglang_s_formulas():
    p = problem(64)
    s = to_sglang(p)
    B, T, pg = p.B, p.T, p.page_size
    P = [int(x) for x in p.prefix_lens]
    assert s.q.shape == (B * T, p.H, 576) and same(s.q[3 * T + 5], p.q[3, 5])
    assert s.k_buffer.shape == (p.kv_cache.shape[0] * pg, 1, 576)
    assert same(s.v_buffer, s.k_buffer[..., :512]) and same(s.v_extend, s.k_extend[..., :512])
    nan_rows = np.isnan(p.kv_cache.astype(np.float32)).all(-1).reshape(-1)
    assert nan_rows.any() and np.isnan(s.k_buffer[nan_rows].astype(np.float32)).all()  # unused slots stay NaN
    assert s.qo_indptr.dtype == np.int32 and s.qo_indptr.tolist() == [b * T for b in range(B + 1)]
    assert s.kv_indptr.dtype == np.int32 and s.kv_indptr.tolist() == [sum(P[:b]) for b in range(B + 1)]
    assert s.kv_indices.dtype == np.int64 and s.out_cache_loc.dtype == np.int64
    for b in range(B):
        slot = [int(p.block_table[b, j // pg]) * pg + j % pg for j in range(P[b] + T)]  # page * page_size + offset
        assert s.kv_indices[s.kv_indptr[b] : s.kv_indptr[b + 1]].tolist() == slot[: P[b]]
        assert s.out_cache_loc[b * T : (b + 1) * T].tolist() == slot[P[b] :]
        assert s.req_to_token[s.req_pool_indices[b], : P[b] + T].tolist() == slot
        assert same(s.k_extend[b * T : (b + 1) * T, 0], p.kv_cache.reshape(-1, 576)[slot[P[b] :]])


def test_full_mask_is_sglang_s_flat_row_major_layout():
    p = problem(64)
    s = to_sglang(p)
    T = p.T
    P = [int(x) for x in p.prefix_lens]
    offsets = [0]
    for x in P:
        offsets.append(offsets[-1] + T * (x + T))  # mask_indptr = cumsum(T * (P + T))
    assert s.mask_indptr.tolist() == offsets and s.custom_mask.dtype == np.bool_
    assert s.custom_mask.shape == (offsets[-1],)
    for b in range(p.B):
        for t in range(T):
            row = [bool(s.custom_mask[offsets[b] + t * (P[b] + T) + j]) for j in range(P[b] + T)]
            assert all(row[: P[b]]), (b, t)  # every prefix column visible
            assert row[P[b] :] == [sees(p.tree_parent[b], t, c) for c in range(T)], (b, t)


def test_bitpacked_mask_is_kdtr_s_words_and_has_a_limit():
    p = problem(1, budget=31)  # T = 32: every bit of the word in use
    s = to_sglang(p, bitpacked=True)
    assert s.custom_mask.dtype == np.uint32 and same(s.custom_mask, p.tree_mask[:, :, 0].reshape(-1))
    for b in range(p.B):
        for t in range(p.T):
            want = sum(1 << c for c in range(p.T) if sees(p.tree_parent[b], t, c))
            assert int(s.custom_mask[b * p.T + t]) == want
    assert s.mask_indptr.tolist() == s.qo_indptr.tolist()
    with pytest.raises(ValueError, match="T <= 32.*T = 33"):
        to_sglang(problem(1, budget=32), bitpacked=True)


@pytest.mark.parametrize("dtype", [np.int16, np.int32, np.uint32])
def test_sglang_s_narrow_signed_bitpacked_words_unpack_to_kdtr_words(dtype):
    p = problem(1, budget=15, prefix_lens=(3, 0))  # T = 16: node 15's bit is int16's sign bit
    arrays = to_sglang(p, bitpacked=True).arrays()
    arrays["custom_mask"] = arrays["custom_mask"].astype(np.int64).astype(dtype)
    assert same(from_sglang(arrays, p.T, p.H).tree_mask, p.tree_mask)


def test_k_extend_lands_in_the_pool_at_out_cache_loc():
    p = problem(1, prefix_lens=(5, 0))
    arrays = to_sglang(p).arrays()
    pool = arrays["k_buffer"].copy()
    pool[arrays["out_cache_loc"]] = np.nan  # the tail not written yet: k_extend carries it
    arrays["k_buffer"] = pool
    back = from_sglang(arrays, p.T, p.H)
    assert same(back.kv_cache, p.kv_cache) and np.isnan(pool[arrays["out_cache_loc"]].astype(np.float32)).all()


def test_without_req_to_token_the_block_table_is_gathered_from_the_indices():
    p = problem(1)
    arrays = {k: v for k, v in to_sglang(p).arrays().items() if k not in ("req_to_token", "req_pool_indices")}
    back = from_sglang(arrays, p.T, p.H)
    for b in range(p.B):
        assert same(back.tokens(b), p.tokens(b))


def _break(name):
    def edit(a):
        if name == "q":
            a["q"] = a["q"][:-1]
        elif name == "prefix_hidden":
            a["custom_mask"] = a["custom_mask"].copy()
            a["custom_mask"][a["mask_indptr"][2]] = False  # request 2 (P = 1), row 0, prefix column 0
        elif name == "not_a_tree":
            a["custom_mask"] = a["custom_mask"].copy()
            a["custom_mask"][a["mask_indptr"][1] + 1] = True  # request 1 (P = 0), row 0: the root sees node 1
        elif name == "mask_indptr":
            a["mask_indptr"] = a["mask_indptr"] + 1
        elif name == "slot":
            a["kv_indices"] = a["kv_indices"].copy()
            a["kv_indices"][0] = a["k_buffer"].shape[0]
        elif name == "qo_indptr":
            a["qo_indptr"] = a["qo_indptr"] * 2
        elif name == "req_to_token":
            a["req_to_token"] = a["req_to_token"][:, ::-1].copy()
        elif name == "kv_indptr":
            a["kv_indptr"] = a["kv_indptr"][::-1].copy()
        elif name == "missing":
            del a["scale"]
    return edit


@pytest.mark.parametrize("name, fragment", [
    ("q", "q must be [B*T, H, 576]"),
    ("prefix_hidden", "request 2: custom_mask hides a prefix token"),
    ("not_a_tree", "request 1: custom_mask is not a draft tree's ancestor mask"),
    ("mask_indptr", "mask_indptr must be 0 then cumsum"),
    ("slot", "point outside k_buffer"),
    ("qo_indptr", "qo_indptr must be arange"),
    ("req_to_token", "req_to_token disagrees"),
    ("kv_indptr", "kv_indptr must be [B+1]"),
    ("missing", "from_sglang needs scale"),
])
def test_bad_sglang_buffers_are_one_line_errors(name, fragment):
    p = problem(1, budget=4, prefix_lens=(3, 0, 1))
    arrays = to_sglang(p).arrays()
    _break(name)(arrays)
    with pytest.raises(ValueError) as e:
        from_sglang(arrays, p.T, p.H)
    assert fragment in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_cuda_callables_get_the_same_tensors_as_raw_storage_bits():
    """The device upload, with numpy standing in for cupy: bf16 as uint16 bits, V a view of K's columns."""
    import sglang_kernels
    from kdtr.kernels.python import SGLANG_ARGS, PyCallableKernel

    p = problem(64, budget=4, prefix_lens=(3, 0))
    kernel = PyCallableKernel(sglang_kernels.attend, "attend")
    host, dev = kernel._host_args(p), kernel._device_args(np, p, "bf16")
    assert len(dev) == len(SGLANG_ARGS)
    for name, h, d in zip(SGLANG_ARGS, host, dev):
        want = h.view(np.uint16) if h.dtype.name == "bfloat16" else h
        assert same(d, want), name
    assert np.shares_memory(dev[SGLANG_ARGS.index("v_buffer")], dev[SGLANG_ARGS.index("k_buffer")])


CI = ["kimi-h2-p31.130-ddtree3u-pg64-bf16-s0", "kimi-h4-p64-star16-pg1-bf16-s0",
      "kimi-h8-p0.1.63.64.65-root-pg1-fp32-s0", "dsv3-h2-p1-ddtree64m-pg1-fp32obf16-s0"]
"""A tree on 64-token pages, a star on 1-token pages, decode over page edges, T = 65 (past bit-packing)."""


def verify(kdtr, tmp_path, fn, mode=("--no-isolate",)):
    path = tmp_path / "r.json"
    r = kdtr("verify", "-k", f"{KERNELS}:{fn}", *mode, "--json", path, *[GOLDENS_CI / f"{n}.kdtr" for n in CI])
    assert path.exists(), r.output
    return r, json.loads(path.read_text())


@pytest.mark.parametrize("mode", [(), ("--no-isolate",)], ids=["isolated", "in-process"])
def test_an_sglang_layout_kernel_passes_committed_goldens(kdtr, tmp_path, mode):
    r, rep = verify(kdtr, tmp_path, "attend", mode)
    assert r.exit_code == 0 and rep["counts"] == {"PASS": len(CI)} and rep["lse_checked"], r.output


def test_the_bitpacked_layout_passes_and_skips_trees_past_32_nodes(kdtr, tmp_path):
    r, rep = verify(kdtr, tmp_path, "attend_bitpacked")
    assert r.exit_code == 0 and rep["counts"] == {"PASS": 3, "SKIPPED": 1}, r.output
    assert "max_T=32" in r.stdout


def test_an_sglang_layout_kernel_ignoring_the_mask_fails(kdtr, tmp_path):
    r, rep = verify(kdtr, tmp_path, "ignores_mask")
    assert r.exit_code == 1 and rep["counts"] == {"FAIL_NUMERIC": 3, "PASS": 1}, rep["counts"]  # decode has no tree


def test_an_output_in_the_wrong_shape_names_the_sglang_shape(kdtr, tmp_path):
    r, rep = verify(kdtr, tmp_path, "flat_out")
    assert rep["counts"] == {"RUNTIME_ERROR": len(CI)}
    assert all("[B*T, H, 512]" in res["message"] for res in rep["results"])


def test_an_unknown_layout_is_one_line(kdtr):
    r = kdtr("verify", "-k", f"{KERNELS}:unknown_layout", GOLDENS_CI / f"{CI[0]}.kdtr")
    assert r.exit_code == 2 and "kdtr_layout must be one of" in r.stderr, r.output
    assert len(r.stderr.strip().splitlines()) == 1
