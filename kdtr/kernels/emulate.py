"""CPU emulation of a tiled bf16 tensor-core flash verify kernel ("emulate-flash").

Why it exists: the fp64 reference says what the answer is, but not what error a correct bf16
kernel makes. This module reproduces, in numpy float32, the arithmetic of the kernels kdtr ships
for sm_90 / sm_120, so the whole verify pipeline (bundles, compare, tolerances, planted bugs)
runs in CI without a GPU and shows realistic bf16 error. Steps, and what each mirrors:

1. Load. q and the latent cache are bf16 in memory; widening to fp32 is exact. Keys come
   through the block table (page = block_table[b, j // page_size]), as a paged kernel reads.
2. Split-KV (flash-decoding). The prefix [0, P) is cut into splits of ``split_len`` keys
   (a tile multiple), the tree tail [P, P + T) is one more split. All H*T rows of a request
   (row = node * H + head) share the stream, as MQA tiles pack (node, head) rows.
3. Scores. S = q @ k^T as an fp32 GEMM of bf16 values (mma.sync / wgmma: bf16 x bf16 products
   are exact in fp32, accumulation in fp32), then S *= scale in fp32. Tail keys get the tree
   mask (-inf). A tail tile no row sees contributes P = 0 and leaves the running max alone,
   so skipping it (a pure speed matter on the GPU) needs no emulation.
4. Online softmax per KV tile of ``tile`` keys: running row max m, P = exp(S - m) in fp32,
   row sum l from the fp32 P, then P rounded to bf16 (cvt.rn.bf16x2.f32: it is the A operand of
   the P @ V MMA) and acc += P_bf16 @ V in fp32, with acc and l rescaled by exp(m_old - m_new).
   The emulation applies the rescales folded: tile t's bf16 P is scaled by exp(m_t - m_final)
   before one GEMM per split. That equals the per-tile loop up to fp32 rounding (~1e-7), while
   the bf16 rounding of P happens exactly where the GPU does it: relative to the running max.
5. Split epilogue: o_s = acc / l, lse_s = m + log l (fp32), as a partial-result buffer.
6. Combine kernel: M = max lse_s, w_s = exp(lse_s - M), out = sum w_s o_s / sum w_s,
   lse = M + log sum w_s, all fp32 (the partials o_s travel as fp32, as every kdtr kernel stores them).
7. Store: out rounded to the output dtype (bf16 round-to-nearest-even), lse fp32.

Planted bugs (kdtr/kernels/bugs.py) are variants of these steps, implemented exactly as defined there;
Bug.BAKED_LENGTHS lives in the launch, not in these steps: a plain run is the correct one.

For ``kdtr verify --graph`` without a GPU, the end of the module mirrors a CUDA graph capture: host
buffers that stay put (HostBuffers), a prepare step that decides the launch's plan (EmulatePlan) and a
mock capture that freezes the launch as prepared (MockGraph), replayed on whatever the buffers hold.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from kdtr.kernels import bugs
from kdtr.kernels.bugs import Bug
from kdtr.kernels.contract import POISON_BF16_BITS, POISON_F32_BITS
from kdtr.kernels.launch_types import INPUTS, RunOutput, check_upload
from kdtr.inputs.presets import DK, DV
from kdtr.inputs.problem import Problem
from kdtr.inputs.trees import unpack_mask

MAX_SPLITS = 16
"""Most prefix splits per request (a GPU has a few times more SMs than requests)."""
SPLIT_MIN_KEYS = 512
"""A prefix gets one split per this many keys (up to MAX_SPLITS)."""
OUT_DTYPES = ("bf16", "fp32")

_F32 = np.float32
_BF16 = ml_dtypes.bfloat16


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def default_split_len(P: int, tile: int = bugs.TILE) -> int:
    """Keys per prefix split as a GPU scheduler picks it: about P / min(16, P // 512)."""
    n_splits = max(1, min(MAX_SPLITS, P // SPLIT_MIN_KEYS))
    return max(tile, round_up(-(-P // n_splits), tile))


def split_bounds(P: int, split_len: int, tile: int = bugs.TILE) -> list[tuple[int, int]]:
    """[(start, stop)] of the prefix splits of [0, P); empty for P = 0."""
    if tile < 1:
        raise ValueError(f"tile must be >= 1, got {tile}")
    if split_len < tile or split_len % tile:
        raise ValueError(f"split_len must be a positive multiple of tile={tile}, got {split_len}")
    return [(s, min(P, s + split_len)) for s in range(0, P, split_len)]


def round_to(x: np.ndarray, dtype: str) -> np.ndarray:
    """float32 copy of x with the values of `dtype` ("bf16": round-to-nearest-even)."""
    if dtype == "bf16":
        return x.astype(_BF16).astype(_F32)
    if dtype == "fp32":
        return x.astype(_F32, copy=True)
    raise ValueError(f"out_dtype must be one of {OUT_DTYPES}, got {dtype!r}")


def _keys(p: Problem, b: int, n: int, bug: Bug) -> np.ndarray:
    """[n, 576] float32 cache rows of request b's tokens 0..n-1, read through the block table as planted bug
    ``bug`` reads them (PAGE_OFF_BY_ONE, BLOCK_TABLE_STRIDE, TAIL_POSITION)."""
    j = np.arange(n, dtype=np.int64)
    P = n - p.T
    if bug is Bug.TAIL_POSITION:
        j[P:] -= P
    pg, width = p.page_size, p.block_table.shape[1]
    col = (j + 1) // pg if bug is Bug.PAGE_OFF_BY_ONE else j // pg
    row = b * (-(-n // pg) if bug is Bug.BLOCK_TABLE_STRIDE else width)
    # A read past the row continues into the next one, as flat GPU indexing does (clamped).
    flat_bt = p.block_table.reshape(-1)
    page = flat_bt[np.minimum(row + col, flat_bt.size - 1)].astype(np.int64)
    return p.kv_cache.reshape(-1, DK)[page * pg + j % pg].astype(_F32)


def _tail_mask(p: Problem, b: int, bug: Bug) -> np.ndarray:
    """[T, T] bool: node r sees tail node c, as planted bug ``bug`` reads the tree mask."""
    T, W = p.T, p.tree_mask.shape[2]
    words = p.tree_mask[0 if bug is Bug.MASK_REQUEST0 else b]  # [T, W]
    if bug is Bug.MASK_STRIDE:  # the row stride of a T + 1-node mask, the mask's last word past its end
        at = (b * T + np.arange(T)[:, None]) * (T // 32 + 1) + np.arange(W)
        flat = p.tree_mask.reshape(-1)
        words = flat[np.minimum(at, flat.size - 1)]
    if bug is Bug.MASK_BIT_ORDER:  # bit 31 - c % 32: the words' bits reversed
        bits = np.unpackbits(np.ascontiguousarray(words, "<u4").view(np.uint8), axis=1, bitorder="little")
        words = np.packbits(bits.reshape(T, W, 32)[:, :, ::-1], axis=2, bitorder="little").reshape(T, 4 * W).view("<u4")
    vis = unpack_mask(words, T)
    if bug is Bug.SIBLING_VISIBLE and T > 1:
        vis[np.arange(1, T), np.arange(T - 1)] = True
    if bug is Bug.CAUSAL_MASK:
        vis = np.tri(T, dtype=bool)
    if bug is Bug.NO_SELF:
        vis[np.arange(T), np.arange(T)] = False
    return vis


def _partial(q, k, v, scale, vis, tile, no_max: bool = False):
    """One split's flash loop: (acc [R, 512], m [R], l [R]) in fp32.

    q [R, d] and k [n, d] fp32 holding bf16 values, v [n, 512]; vis [R, n] bool or None (all seen).
    no_max: NO_RUNNING_MAX, the maximum taken as 0 wherever a key was seen (p = exp(s)).
    """
    R, n = q.shape[0], k.shape[0]
    nt = -(-n // tile)
    pad = nt * tile - n
    if pad:  # the ragged last tile: out-of-range keys masked, as a predicated load does
        k = np.concatenate([k, np.zeros((pad, k.shape[1]), _F32)])
        v = np.concatenate([v, np.zeros((pad, DV), _F32)])
    s = q @ k.T  # [R, nt*tile] fp32 GEMM
    s *= scale
    if vis is not None:
        np.copyto(s[:, :n], _F32(-np.inf), where=~vis)
    s[:, n:] = -np.inf
    s3 = s.reshape(R, nt, tile)  # [R, nt, tile]
    m_run = np.maximum.accumulate(s3.max(axis=2), axis=1)  # [R, nt] running max after each tile
    dead = np.isneginf(m_run)  # no visible key yet: subtract 0, as the -inf guard of FA kernels
    if no_max:
        m_run = np.where(dead, m_run, _F32(0))
    m_sub = np.where(dead, _F32(0), m_run)
    s3 -= m_sub[:, :, None]
    np.exp(s3, out=s3)  # P fp32
    with np.errstate(over="ignore"):
        c = np.where(dead, _F32(0), np.exp(m_sub - m_sub[:, -1:]))  # [R, nt] rescale to final m
    l = (s3.sum(axis=2) * c).sum(axis=1)  # [R] from fp32 P
    p16 = s3.astype(_BF16).astype(_F32)  # P rounded to bf16 for the P @ V MMA
    p16 *= c[:, :, None]
    acc = p16.reshape(R, nt * tile) @ v  # [R, 512] fp32 accumulation
    return acc, m_run[:, -1], l


def _combine(parts, bug: Bug = Bug.NONE, out_dtype: str = "fp32"):
    """Merge split partials by LSE: out [R, 512], lse [R] (fp32). The partials as planted bug ``bug`` writes
    them (LSE_LOG2: lse in base 2; OUT_TRUNCATE with bf16 out: rows rounded toward zero to bf16); MERGE_WRONG_MAX
    merges them wrongly. A row no split saw is out 0, lse -inf, as the kernels leave it (planted mask bugs)."""
    wrong_max = bug is Bug.MERGE_WRONG_MAX
    acc = [a for a, _, _ in parts]
    m = np.stack([x for _, x, _ in parts])  # [S, R]
    l = np.stack([x for _, _, x in parts])  # [S, R]
    if wrong_max:  # MERGE_WRONG_MAX: each split's max taken as global, w_s = l_s
        lsum = l.sum(axis=0)
        with np.errstate(divide="ignore", invalid="ignore"):
            return sum(acc) / lsum[:, None], m.max(axis=0) + np.log(lsum)
    empty = l == 0  # a split no key of which the row sees
    l1 = np.where(empty, _F32(1), l)
    lse_s = np.where(empty, _F32(-np.inf), m + np.log(l1))  # [S, R]
    if bug is Bug.LSE_LOG2:
        lse_s *= _F32(np.log2(np.e))
    seen = ~np.isneginf(lse_s.max(axis=0))  # [R]: always, but for planted mask bugs
    M = np.where(seen, lse_s.max(axis=0), _F32(0))  # [R]
    w = np.exp(lse_s - M)  # [S, R]
    o = [acc[s] / l1[s, :, None] for s in range(len(acc))]  # [R, 512] each
    if bug is Bug.OUT_TRUNCATE and out_dtype == "bf16":
        o = [(x.view(np.uint32) & np.uint32(0xFFFF0000)).view(_F32) for x in o]
    out = sum(w[s, :, None] * o[s] for s in range(len(acc)))
    wsum = np.where(seen, w.sum(axis=0), _F32(1))
    return out / wsum[:, None], np.where(seen, M + np.log(wsum), _F32(-np.inf))


def emulate_request(p: Problem, b: int, bug: Bug, tile: int, split_len: int | None, out_dtype: str = "fp32"):
    """out [T, H, 512] and lse [T, H] (fp32, out not yet rounded) of request b."""
    T, H = p.T, p.H
    R = T * H
    P = int(p.prefix_lens[b])
    kv = _keys(p, b, P + T, bug)  # [P+T, 576]
    q = p.q[b].reshape(R, DK).astype(_F32)  # [R, 576], row = node * H + head
    if bug is Bug.Q_HEAD_MAJOR:  # row (t, h) read from row h * T + t
        r = np.arange(R)
        q = q[r % H * T + r // H]
    d = DV if bug is Bug.NO_ROPE else DK
    v0 = DK - DV if bug is Bug.V_COLUMNS else 0
    qd, kd, v = q[:, :d], kv[:, :d], kv[:, v0:v0 + DV]
    scale = _F32(p.scale * {Bug.SCALE_OFF: 1.01, Bug.MISSING_LOG2E: np.log(2)}.get(bug, 1))
    no_max = bug is Bug.NO_RUNNING_MAX

    p_end = P  # prefix keys actually visited
    if bug is Bug.DROP_PREFIX_KEY and P > 0:
        p_end = P - 1
    elif bug is Bug.DROP_PARTIAL_TILE:
        p_end = bugs.TILE * (P // bugs.TILE)
    sl = default_split_len(P, tile) if split_len is None else split_len
    parts = []
    for s0, s1 in split_bounds(P, sl, tile):
        s1 = min(s1, p_end)
        if s1 > s0:
            parts.append(_partial(qd, kd[s0:s1], v[s0:s1], scale, None, tile, no_max))

    vis = np.repeat(_tail_mask(p, b, bug), H, axis=0)  # [R, T] row r sees tail key c
    tail = [(0, T)]
    if bug is Bug.MERGE_WRONG_MAX and not parts and T > 1:
        tail = [(0, (T + 1) // 2), ((T + 1) // 2, T)]  # one split only: plant a 2-way split
    for c0, c1 in tail:
        sel = slice(P + c0, P + c1)
        parts.append(_partial(qd, kd[sel], v[sel], scale, vis[:, c0:c1], tile, no_max))

    out, lse = _combine(parts, bug, out_dtype)
    return out.reshape(T, H, DV), lse.reshape(T, H)


def emulate_flash(
    problem: Problem,
    out_dtype: str = "bf16",
    bug: Bug = Bug.NONE,
    *,
    tile: int = bugs.TILE,
    split_len: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """out [B, T, H, 512] float32 (values of out_dtype) and lse [B, T, H] float32.

    bf16 storage only (ValueError otherwise). split_len: prefix keys per split, a multiple of
    tile; None picks default_split_len(P_b) per request. bug: a planted bug (kdtr/kernels/bugs.py).
    """
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype!r}")
    problem.validate()
    if problem.kv_dtype != "bf16":
        raise ValueError(f"emulate-flash takes bf16 storage only, got {problem.kv_dtype}")
    bug = Bug(bug)
    if split_len is not None:
        split_bounds(0, split_len, tile)  # validate once
    out = np.empty(problem.out_shape(), dtype=_F32)  # [B, T, H, 512]
    lse = np.empty((problem.B, problem.T, problem.H), dtype=_F32)  # [B, T, H]
    with np.errstate(invalid="ignore", over="ignore"):  # NaN read by PAGE_OFF_BY_ONE, NO_RUNNING_MAX's inf: as on a GPU
        for b in range(problem.B):
            out[b], lse[b] = emulate_request(problem, b, bug, tile, split_len, out_dtype)
    return round_to(out, out_dtype), lse


# ---- graph capture without a GPU (kdtr verify --graph) -----------------------------------------------

class HostBuffers:
    """A problem's inputs and outputs in host arrays that stay put, as kdtr.kernels.launch.DeviceProblem keeps
    them on a GPU: a mock-captured launch holds these arrays and reads whatever they contain when replayed.

    q and kv_cache keep the storage dtype (bf16 as ml_dtypes.bfloat16); out is float32 holding the output
    dtype's values (a bf16 output widened exactly), lse float32."""

    def __init__(self, problem: Problem, out_dtype: str):
        if out_dtype not in OUT_DTYPES:
            raise ValueError(f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype!r}")
        problem.validate()
        self.problem, self.out_dtype = problem, out_dtype
        for name in INPUTS:
            setattr(self, name, np.array(getattr(problem, name), order="C", copy=True))
        self.out = np.empty(problem.out_shape(), _F32)  # [B, T, H, 512]
        self.lse = np.empty((problem.B, problem.T, problem.H), _F32)  # [B, T, H]

    def upload(self, problem: Problem) -> None:
        """Write ``problem``'s inputs into these arrays in place; ValueError, naming the first, where a shape or
        dtype differs (a captured launch takes inputs of its own shapes only). out and lse stay as they are."""
        problem.validate()
        check_upload({name: getattr(self, name) for name in INPUTS}, {name: getattr(problem, name) for name in INPUTS})
        for name in INPUTS:
            np.copyto(getattr(self, name), getattr(problem, name))
        self.problem = problem

    def poison(self) -> None:
        """The poison patterns of kdtr.kernels.contract in out and lse, as a GPU run writes them first (an
        element the launch leaves alone reads UNWRITTEN)."""
        bits = POISON_F32_BITS if self.out_dtype == "fp32" else POISON_BF16_BITS << 16  # bf16 poison, widened
        self.out.view(np.uint32).fill(bits)
        self.lse.view(np.uint32).fill(POISON_F32_BITS)

    def download(self) -> tuple[np.ndarray, np.ndarray]:
        """Copies of out and lse (the next replay overwrites the buffers)."""
        return self.out.copy(), self.lse.copy()

    def current(self, prefix_lens: np.ndarray | None = None) -> Problem:
        """The Problem the buffers hold now (no copy); ``prefix_lens`` read in place of theirs."""
        p = self.problem
        return Problem(q=self.q, kv_cache=self.kv_cache, block_table=self.block_table,
                       prefix_lens=self.prefix_lens if prefix_lens is None else prefix_lens,
                       tree_parent=p.tree_parent, tree_depth=p.tree_depth, tree_mask=self.tree_mask, scale=p.scale)


class MockGraph:
    """What capture makes of a launch without a GPU: the launch closure as prepared, frozen. Replaying calls
    it on the buffers' current contents, so whatever the prepare step decided stays decided, as in a graph."""

    def __init__(self, launch):
        self.launch = launch

    def replay(self):
        return self.launch()


class HostGraphRun:
    """The runner verify --graph drives (the host twin of kdtr.kernels.launch.GraphRun): ``load`` writes a
    problem's inputs into the captured buffers, ``replay`` poisons the outputs and replays the mock graph.

    A launch closure writes out and lse into the buffers and returns None, or returns its own (out, lse)
    (a Python callable's results), which are used instead."""

    def __init__(self, name: str, buffers: HostBuffers, graph: MockGraph):
        self.name, self.buffers, self.graph = name, buffers, graph

    def load(self, problem: Problem) -> None:
        self.buffers.upload(problem)

    def replay(self) -> RunOutput:
        self.buffers.poison()
        t0 = time.perf_counter()
        got = self.graph.replay()
        ms = (time.perf_counter() - t0) * 1e3
        out, lse = self.buffers.download() if got is None else got
        return RunOutput(out, lse, ms)


@dataclass(frozen=True)
class EmulatePlan:
    """What emulate-flash's launch decides when it is prepared. A graph-safe kernel decides from shapes alone:
    the split keys come from the buffers' prefix lengths at every run, as a device-side scheduler does."""

    out_dtype: str
    """Output dtype written."""
    bug: Bug
    """The planted bug emulated (kdtr/kernels/bugs.py)."""
    tile: int
    """Keys per KV tile."""
    baked_lens: tuple[int, ...] | None = None
    """Bug.BAKED_LENGTHS: the prefix lengths the buffers held when the launch was prepared, which every run
    reads in place of the buffers' own; None: the buffers' own at every run."""


def prepare_emulation(buffers: HostBuffers, out_dtype: str, bug: Bug = Bug.NONE, tile: int = bugs.TILE) -> EmulatePlan:
    """The plan of a launch on ``buffers``: everything the host decides before it launches."""
    bug = Bug(bug)
    baked = tuple(int(p) for p in buffers.prefix_lens) if bug is Bug.BAKED_LENGTHS else None
    return EmulatePlan(out_dtype, bug, tile, baked)


def run_plan(plan: EmulatePlan, buffers: HostBuffers) -> None:
    """One launch of ``plan`` on the buffers' current contents: out and lse written in place."""
    lens = None if plan.baked_lens is None else np.asarray(plan.baked_lens, np.int32)
    out, lse = emulate_flash(buffers.current(lens), plan.out_dtype, plan.bug, tile=plan.tile)
    buffers.out[...] = out
    buffers.lse[...] = lse


def capture_emulation(name: str, problem: Problem, out_dtype: str, bug: Bug = Bug.NONE) -> HostGraphRun:
    """emulate-flash prepared on buffers holding ``problem`` and mock-captured: its plan frozen in the closure
    that every replay runs (kdtr verify --graph without a GPU)."""
    buffers = HostBuffers(problem, out_dtype)
    plan = prepare_emulation(buffers, out_dtype, bug)
    return HostGraphRun(name, buffers, MockGraph(lambda: run_plan(plan, buffers)))
