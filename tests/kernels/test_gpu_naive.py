"""The naive CUDA kernel against a float64 reference on a GPU (skipped cleanly without one).

Self-contained: a small Problem builder (random topological trees, shuffled pages, NaN in every
slot a request does not own) and a direct float64 reference, so these tests depend only on
kdtr.inputs.problem / kdtr.kernels.launch / kdtr.kernels.registry.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from kdtr.kernels import launch
from kdtr.kernels.bugs import PLAIN, SHOWS_ON, Bug
from kdtr.kernels.registry import resolve_kernel, variant_name
from kdtr.inputs.presets import DK, DV
from kdtr.inputs.problem import Problem, mask_words
from kdtr.inputs.rng import Stream

pytestmark = pytest.mark.gpu

SCALE = 0.1352  # DeepSeek-V3's


# ---- inputs and reference ----------------------------------------------------------------------


def pack_mask(vis: np.ndarray) -> np.ndarray:
    """[..., T, T] bool -> [..., T, ceil(T/32)] uint32 (bit c%32 of word c//32)."""
    T = vis.shape[-1]
    words = np.zeros(vis.shape[:-1] + (mask_words(T),), np.uint32)
    for c in range(T):
        words[..., c // 32] |= vis[..., c].astype(np.uint32) << np.uint32(c % 32)
    return words


def build_problem(seed, prefix_lens, T, H, page_size, kv_dtype="fp32", *, rand=None) -> Problem:
    """B = len(prefix_lens) requests, random trees (parent[i] uniform in [0, i)), shuffled pages.

    ``rand`` (an np.random.Generator) replaces the exact Stream for big inputs in speed tests.
    """
    B = len(prefix_lens)
    s = Stream(seed, "test-gpu-naive", T, H, page_size, kv_dtype, *prefix_lens)
    uniform = rand.random if rand is not None else s.uniform
    normal = (lambda shape: rand.standard_normal(shape, np.float32)) if rand is not None else s.normalish

    parent = np.full((B, T), -1, np.int32)
    depth = np.zeros((B, T), np.int32)
    vis = np.zeros((B, T, T), bool)
    for b in range(B):
        parent[b, 1:] = np.floor(uniform((T - 1,)) * np.arange(1, T)).astype(np.int32)
        for i in range(T):
            if i:
                vis[b, i] = vis[b, parent[b, i]]
                depth[b, i] = depth[b, parent[b, i]] + 1
            vis[b, i, i] = True

    need = [math.ceil((p + T) / page_size) for p in prefix_lens]
    num_pages = sum(need) + 1  # + one NaN page for the spare block-table entries
    perm = s.permutation(num_pages)
    nan_page = int(perm[-1])
    max_pages = max(need) + 1
    block_table = np.full((B, max_pages), nan_page, np.int32)
    kv = np.full((num_pages, page_size, DK), np.nan, np.float32)
    start = 0
    for b, p in enumerate(prefix_lens):
        pages = perm[start : start + need[b]]
        start += need[b]
        block_table[b, : need[b]] = pages
        j = np.arange(p + T)
        kv.reshape(-1, DK)[pages[j // page_size] * page_size + j % page_size] = np.asarray(normal((p + T, DK)), np.float32)
    q = np.asarray(normal((B, T, H, DK)), np.float32)
    if kv_dtype == "bf16":
        q, kv = q.astype(ml_dtypes.bfloat16), kv.astype(ml_dtypes.bfloat16)
    pr = Problem(
        q=q, kv_cache=kv, block_table=block_table, prefix_lens=np.asarray(prefix_lens, np.int32),
        tree_parent=parent, tree_depth=depth, tree_mask=pack_mask(vis), scale=SCALE,
    )
    pr.validate()
    return pr


def reference64(pr: Problem, rows=None):
    """float64 out [B, T, H, 512] and lse [B, T, H]; ``rows``: only these (b, t) pairs."""
    out = np.full(pr.out_shape(), np.nan)
    lse = np.full((pr.B, pr.T, pr.H), np.nan)
    bits = ((pr.tree_mask[..., :, None] >> np.arange(32, dtype=np.uint32)) & 1).astype(bool)
    vis = bits.reshape(pr.B, pr.T, -1)[..., : pr.T]
    for b in range(pr.B):
        P = int(pr.prefix_lens[b])
        K = pr.gather_kv(b, 0, P + pr.T)
        for t in range(pr.T):
            if rows is not None and (b, t) not in rows:
                continue
            keys = np.concatenate([np.arange(P), P + np.flatnonzero(vis[b, t])])
            s = pr.scale * (pr.q[b, t].astype(np.float64) @ K[keys].T)  # [H, n]
            m = s.max(axis=1, keepdims=True)
            e = np.exp(s - m)
            l = e.sum(axis=1, keepdims=True)
            out[b, t] = (e @ K[keys, :DV]) / l
            lse[b, t] = (m + np.log(l))[:, 0]
    return out, lse


def max_err(a, r) -> float:
    """max |a - r| with NaN (an unwritten or poisoned element) counted as infinite."""
    d = np.abs(a.astype(np.float64) - r)
    return float(np.where(np.isnan(d), np.inf, d).max())


def run(name, pr, out_dtype="fp32"):
    return resolve_kernel(name).run(pr, out_dtype)


# ---- correctness -------------------------------------------------------------------------------

PREFIXES = (0, 1, 63, 64, 65, 700)
PARTNER = {0: 65, 1: 0, 63: 700, 64: 1, 65: 63, 700: 64}  # second request: prefix lengths vary
HEADS = {1: 16, 5: 3, 33: 3}  # T*H = 16 (one block), 15 (a partial block), 99


@pytest.mark.parametrize("out_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("T", [1, 5, 33])
@pytest.mark.parametrize("P", PREFIXES)
@pytest.mark.parametrize("page_size", [1, 64])
@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16"])
def test_naive_matches_float64_reference(kv_dtype, page_size, P, T, out_dtype):
    pr = build_problem(1, [P, PARTNER[P]], T, HEADS[T], page_size, kv_dtype)
    res = run("naive", pr, out_dtype)
    ref_out, ref_lse = reference64(pr)
    assert res.out.shape == pr.out_shape() and res.out.dtype == np.float32
    assert not np.isnan(res.out).any(), "out not fully written (poison NaN left)"
    assert not np.isnan(res.lse).any(), "lse not fully written (poison NaN left)"
    assert max_err(res.lse, ref_lse) < 1e-4
    if out_dtype == "fp32":
        assert max_err(res.out, ref_out) < 1e-4
    else:  # one bf16 rounding of the fp32 result
        excess = np.abs(res.out - ref_out) - (1e-4 + 2.0**-8 * np.abs(ref_out))
        assert excess.max() <= 0, f"worst excess {excess.max():.3g}"


UNSEEN_HERE = (Bug.MASK_STRIDE, Bug.NO_RUNNING_MAX, Bug.OUT_TRUNCATE)
"""Bugs this test's problem cannot show (T = 33, unit-variance scores, fp32 out): SHOWS_ON says what they need."""


@pytest.mark.parametrize("bug", PLAIN, ids=lambda b: b.slug)
@pytest.mark.parametrize("page_size", [1, 64])
def test_naive_planted_bugs_fail(bug: Bug, page_size):
    if bug in UNSEEN_HERE:
        pytest.skip(f"{bug.slug} needs {SHOWS_ON[bug]}; ci has it (tests/check/test_gpu_verify.py)")
    pr = build_problem(2, [700, 65], 33, 3, page_size)
    ref_out, ref_lse = reference64(pr)
    good, bad = run("naive", pr), run(variant_name("naive", bug), pr)
    good_err = max(max_err(good.out, ref_out), max_err(good.lse, ref_lse))
    bad_err = max(max_err(bad.out, ref_out), max_err(bad.lse, ref_lse))  # lse-log2 changes the lse alone
    assert good_err < 1e-4
    assert bad_err > max(1e-3, 50 * good_err), f"{bug.slug}: error {bad_err:.3g} vs correct {good_err:.3g}"


@pytest.mark.parametrize("kv_dtype,out_dtype", [("fp32", "fp32"), ("bf16", "bf16"), ("bf16", "fp32")])
def test_naive_repeat_is_bit_identical(kv_dtype, out_dtype):
    pr = build_problem(3, [700, 1, 64], 33, 5, 64, kv_dtype)
    kern = resolve_kernel("naive")
    dp = launch.DeviceProblem(pr, out_dtype)
    first = kern.run_on(dp)
    for _ in range(3):
        again = kern.run_on(dp)
        assert np.array_equal(first.out.view(np.uint32), again.out.view(np.uint32))
        assert np.array_equal(first.lse.view(np.uint32), again.lse.view(np.uint32))


def test_naive_geometry_comes_from_kdtr_launch():
    loaded = resolve_kernel("naive").load("fp32", "fp32")
    rows, threads, smem, splits = loaded.consts
    assert (rows, threads, splits) == (16, 256, 1)
    assert 48 * 1024 < smem <= 99 * 1024
    assert smem <= launch.device_info()["smem_optin"]


# ---- the user-kernel contract (kdtr_abi.h) -----------------------------------------------------

USER_KERNEL = r"""
#include "kdtr_common.cuh"
%s
template <typename OutT>
__global__ void write_row_ids(const KdtrParams p) {
  const int rows_per_block = %d;
  for (int k = 0; k < rows_per_block; ++k) {
    const int row = blockIdx.x * rows_per_block + k;   // r = t * H + h
    if (row >= p.T * p.H) return;
    const long long g = (long long)blockIdx.y * p.T * p.H + row;
    for (int d = threadIdx.x; d < KDTR_DV; d += blockDim.x)
      static_cast<OutT*>(p.out)[g * KDTR_DV + d] = kdtr::from_float<OutT>(float(d %% 7));
    if (threadIdx.x == 0) p.lse[g] = float(row + 1000 * blockIdx.y);
  }
}
"""


@pytest.mark.parametrize("launch_line,rows_per_block", [("", 1), ('extern "C" __constant__ int kdtr_launch[4] = {3, 64, 0, 1};', 3)])
@pytest.mark.parametrize("out_dtype", ["fp32", "bf16"])
def test_user_cuda_kernel_contract(tmp_path, launch_line, rows_per_block, out_dtype):
    src = tmp_path / "mine.cu"
    src.write_text(USER_KERNEL % (launch_line, rows_per_block))
    pr = build_problem(4, [5, 0], 7, 3, 64)
    res = resolve_kernel(f"{src}:write_row_ids<{{out}}>").run(pr, out_dtype)
    want_lse = np.arange(pr.T * pr.H)[None, :] + 1000 * np.arange(pr.B)[:, None]
    np.testing.assert_array_equal(res.lse, want_lse.reshape(pr.B, pr.T, pr.H).astype(np.float32))
    np.testing.assert_array_equal(res.out, np.broadcast_to(np.arange(DV) % 7, pr.out_shape()).astype(np.float32))


def test_python_callable_kernel(monkeypatch):
    import sys
    import types

    import cupy as cp

    def verify(q, kv_cache, block_table, prefix_lens, tree_mask, *, scale, page_size, out_dtype):
        B, T, H, _ = q.shape
        return cp.full((B, T, H, DV), scale, cp.float32), cp.full((B, T, H), page_size, cp.float32)

    monkeypatch.setitem(sys.modules, "kdtr_test_userkernel", types.SimpleNamespace(verify=verify))
    pr = build_problem(5, [3], 2, 2, 1)
    res = resolve_kernel("kdtr_test_userkernel:verify").run(pr, "fp32")
    assert np.all(res.out == np.float32(SCALE)) and np.all(res.lse == 1)


# ---- speed sanity --------------------------------------------------------------------------------


@pytest.mark.slow
def test_naive_long_prefix_is_not_absurdly_slow():
    """128k prefix, H = 16, T = 257: a few hundred ms expected on an H200; checked on 3 nodes."""
    pr = build_problem(6, [131072], 257, 16, 64, "bf16", rand=np.random.default_rng(0))
    kern = resolve_kernel("naive")
    dp = launch.DeviceProblem(pr, "fp32")
    kern.run_on(dp)  # compile + warm up
    res = kern.run_on(dp)
    rows = {(0, 0), (0, 128), (0, 256)}
    ref_out, ref_lse = reference64(pr, rows)
    for _, t in rows:
        assert max_err(res.out[0, t], ref_out[0, t]) < 1e-4
        assert max_err(res.lse[0, t], ref_lse[0, t]) < 1e-4
    assert res.ms < 3000, f"naive took {res.ms:.0f} ms"
