"""Python-callable kernels for the verify --graph tests (test_graph_capture.py, test_gpu_graph_capture.py here),
spec'd by file: ``tests/check/graph_kernels.py:NAME`` (kdtr puts this folder on sys.path, so children import it).

Each comes as a right one and one that is right in a plain verify but keeps what it saw when it was first
called on a set of buffers (the warm-up before a capture), as a launch that plans on the host does:

- ``cpu_correct`` / ``cpu_baked``: numpy on the CPU (kdtr_device "cpu"), and ``cpu_slow_replay``, right but slow
  whenever it is called again on the same arrays;
- ``cupy_correct`` / ``cupy_baked`` / ``cupy_syncs``: cupy, graph-safe (every length read on the device), or
  planning from host lengths read outside capture, or reading them on the host at every call (capture refuses);
- ``torch_correct`` / ``torch_item``: torch, graph-safe, or calling ``.item()`` (capture refuses).

The GPU ones hold the whole [B, T, H, keys] score tensor: for small bundles only (the graph suite).
"""

from __future__ import annotations

import weakref

import numpy as np

from kdtr.inputs.presets import DK, DV
from kdtr.kernels.emulate import emulate_flash
from kdtr.inputs.problem import Problem


def _tree(tree_mask, T: int):
    """(parent, depth) [B, T] from the packed ancestor mask."""
    B = tree_mask.shape[0]
    bits = (tree_mask[..., :, None] >> np.arange(32, dtype=np.uint32)) & 1
    vis = bits.reshape(B, T, -1)[..., :T].astype(bool)
    idx = np.arange(T)
    parent = np.where(vis & (idx[None, None, :] < idx[None, :, None]), idx, -1).max(-1).astype(np.int32)
    return parent, (vis.sum(-1) - 1).astype(np.int32)


def _emulate(q, kv_cache, block_table, prefix_lens, tree_mask, scale, out_dtype):
    parent, depth = _tree(tree_mask, q.shape[1])
    prob = Problem(q=q, kv_cache=kv_cache, block_table=block_table, prefix_lens=np.array(prefix_lens, np.int32),
                   tree_parent=parent, tree_depth=depth, tree_mask=tree_mask, scale=scale)
    return emulate_flash(prob, out_dtype)


def cpu_correct(q, kv_cache, block_table, prefix_lens, tree_mask, *, scale, page_size, out_dtype):
    return _emulate(q, kv_cache, block_table, prefix_lens, tree_mask, scale, out_dtype)


_SEEN: dict[int, tuple] = {}
"""id(q) -> (weak reference to q, the prefix lengths of the first call on it)."""


def cpu_baked(q, kv_cache, block_table, prefix_lens, tree_mask, *, scale, page_size, out_dtype):
    """Plans on the lengths of its first call on these arrays and keeps the plan for them (weak references, so a
    new array at a recycled address is new)."""
    ref, lens = _SEEN.get(id(q), (None, None))
    if ref is None or ref() is not q:
        lens = np.array(prefix_lens, np.int32)
        _SEEN[id(q)] = (weakref.ref(q), lens)
    return _emulate(q, kv_cache, block_table, lens, tree_mask, scale, out_dtype)


def cpu_slow_replay(q, kv_cache, block_table, prefix_lens, tree_mask, *, scale, page_size, out_dtype):
    """Right, but 0.3 s slower on every call after the first on the same arrays (a replay's)."""
    import time

    ref, _ = _SEEN.get(id(q), (None, None))
    if ref is not None and ref() is q:
        time.sleep(0.3)
    else:
        _SEEN[id(q)] = (weakref.ref(q), None)
    return _emulate(q, kv_cache, block_table, prefix_lens, tree_mask, scale, out_dtype)


for _fn in (cpu_correct, cpu_baked, cpu_slow_replay):
    _fn.kdtr_device = "cpu"


# ---- GPU: cupy and torch ------------------------------------------------------------------------


def _cupy_attend(q, kv_cache, block_table, prefix_lens, tree_mask, scale, page_size, lens=None):
    """out [B, T, H, 512] fp32 and lse [B, T, H]: every key slot of the block table read, the visible ones kept
    (prefix j < P, tail nodes by the mask), all on the device; ``lens``: host lengths to use instead."""
    import cupy as cp

    B, T, H, _ = q.shape
    W = block_table.shape[1] * page_size
    j = cp.arange(W, dtype=cp.int32)
    P = prefix_lens[:, None] if lens is None else cp.stack([cp.full((1,), int(p), cp.int32) for p in lens])
    slot = block_table[:, j // page_size].astype(cp.int64) * page_size + j % page_size  # [B, W]
    f32 = lambda a: (a.astype(cp.uint32) << 16).view(cp.float32) if a.dtype == cp.uint16 else a  # noqa: E731
    k = f32(kv_cache.reshape(-1, DK)[slot])  # [B, W, 576]
    k = cp.where((j[None, :] < P + T)[..., None], k, 0)  # the NaN of unowned slots never reaches a sum
    rel = j[None, :] - P  # [B, W]: tail node index where 0 <= rel < T
    in_tail = (rel >= 0) & (rel < T)
    c = cp.clip(rel, 0, T - 1)
    words = cp.take_along_axis(tree_mask, cp.broadcast_to((c // 32)[:, None, :], (B, T, W)), axis=2)  # [B, T, W]
    sees = ((words >> (c % 32).astype(cp.uint32)[:, None, :]) & 1).astype(bool)
    vis = (j[None, None, :] < P[:, :, None]) | (in_tail[:, None, :] & sees)  # [B, T, W]
    s = (f32(q)[:, :, :, None, :] * k[:, None, None, :, :]).sum(-1) * scale  # [B, T, H, W]
    s = cp.where(vis[:, :, None, :], s, -cp.inf)
    m = s.max(-1, keepdims=True)
    e = cp.exp(s - m)
    l = e.sum(-1, keepdims=True)
    out = (e[..., None] * k[:, None, None, :, :DV]).sum(-2) / l  # [B, T, H, 512]
    return out.astype(cp.float32), (m + cp.log(l))[..., 0].astype(cp.float32)


def cupy_correct(q, kv_cache, block_table, prefix_lens, tree_mask, *, scale, page_size, out_dtype):
    return _cupy_attend(q, kv_cache, block_table, prefix_lens, tree_mask, scale, page_size)


_HOST_LENS: list = []


def cupy_baked(q, kv_cache, block_table, prefix_lens, tree_mask, *, scale, page_size, out_dtype):
    """Reads the lengths on the host, except while a stream captures (where it cannot): then it launches with
    the last ones it read, as a launch planned on the host is frozen at capture."""
    import cupy as cp

    if not cp.cuda.get_current_stream().is_capturing():
        _HOST_LENS[:] = [int(p) for p in cp.asnumpy(prefix_lens)]
    return _cupy_attend(q, kv_cache, block_table, prefix_lens, tree_mask, scale, page_size, lens=list(_HOST_LENS))


def cupy_syncs(q, kv_cache, block_table, prefix_lens, tree_mask, *, scale, page_size, out_dtype):
    """Reads the longest length on the host at every call (a sync): capture refuses it."""
    if int(prefix_lens.max()) < 0:
        raise ValueError("negative length")
    return _cupy_attend(q, kv_cache, block_table, prefix_lens, tree_mask, scale, page_size)


def _torch_attend(q, kv_cache, block_table, prefix_lens, tree_mask, scale, page_size):
    import torch

    B, T, H, _ = q.shape
    W = block_table.shape[1] * page_size
    j = torch.arange(W, device=q.device)
    P = prefix_lens.long()[:, None]
    slot = block_table.long()[:, j // page_size] * page_size + j % page_size
    k = kv_cache.reshape(-1, DK)[slot].float()  # [B, W, 576]
    k = torch.where((j[None, :] < P + T)[..., None], k, torch.zeros((), device=q.device))
    rel = j[None, :] - P
    in_tail = (rel >= 0) & (rel < T)
    c = rel.clamp(0, T - 1)
    words = torch.gather(tree_mask.long() & 0xFFFFFFFF, 2, (c // 32)[:, None, :].expand(B, T, W))
    sees = ((words >> (c % 32)[:, None, :]) & 1).bool()
    vis = (j[None, None, :] < P[:, :, None]) | (in_tail[:, None, :] & sees)
    s = torch.einsum("bthd,bwd->bthw", q.float(), k) * scale
    s = s.masked_fill(~vis[:, :, None, :], float("-inf"))
    lse = torch.logsumexp(s, -1)
    out = torch.einsum("bthw,bwd->bthd", torch.exp(s - lse[..., None]), k[..., :DV])
    return out, lse


def torch_correct(q, kv_cache, block_table, prefix_lens, tree_mask, *, scale, page_size, out_dtype):
    return _torch_attend(q, kv_cache, block_table, prefix_lens, tree_mask, scale, page_size)


def torch_item(q, kv_cache, block_table, prefix_lens, tree_mask, *, scale, page_size, out_dtype):
    """Reads the longest length with .item() (a sync): capture refuses it."""
    if prefix_lens.max().item() < 0:
        raise ValueError("negative length")
    return _torch_attend(q, kv_cache, block_table, prefix_lens, tree_mask, scale, page_size)


for _fn in (torch_correct, torch_item):
    _fn.kdtr_framework = "torch"
