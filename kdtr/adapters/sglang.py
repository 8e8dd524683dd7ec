"""SGLang's target-verify layout (triton backend, SPEC section 8) from a kdtr Problem and back.

SGLang keeps a page-size-1 token pool: slot s holds one token's 576-wide latent, V its first 512
columns. A kdtr page p, offset o is slot ``p * page_size + o``, so any paged cache is already a
token pool once reshaped; its unowned NaN slots stay where they are. Per request b with prefix
P_b and T tree nodes:

- ``kv_indptr = [0, cumsum(P)]`` and ``kv_indices`` the prefix slots only; the tree's own latents
  are ``k_extend`` / ``v_extend``, stored in the pool at ``out_cache_loc``;
- ``qo_indptr = arange(0, (B + 1) T, T)``;
- full mask: ``custom_mask`` flat bool, request b's ``[T, P_b + T]`` row-major block starting at
  ``mask_indptr[b]``, ``mask_indptr = [0, cumsum(T (P + T))]``, prefix columns all True;
- bit-packed mask (T <= 32): one word per query row, bit c set iff the row sees node c (prefix
  implicit), which is kdtr's mask word; ``mask_indptr`` is then the row offset, ``qo_indptr``.
  SGLang stores it in the narrowest integer (uint8 / int16 / int32); from_sglang takes any of them.

``req_to_token[req_pool_indices, :P_b + T]`` (here ``req_pool_indices = arange(B)``) is kdtr's
block table at page size 1.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields

import numpy as np

from kdtr.inputs.presets import DK, DV
from kdtr.inputs.problem import MASK_BITS, Problem
from kdtr.inputs.trees import TreeError, check_tree

MAX_BITPACKED_T = MASK_BITS
"""Most tree nodes the bit-packed mask holds (one 32-bit word per query row)."""


@dataclass(frozen=True, eq=False)
class SglangBatch:
    """One verify launch in SGLang's target-verify layout (B requests, T nodes, H heads)."""

    q: np.ndarray
    """[B*T, H, 576] queries, storage dtype; row b*T + t is node t of request b."""
    k_buffer: np.ndarray
    """[slots, 1, 576] page-size-1 token pool (slot = page * page_size + offset); unowned slots NaN."""
    v_buffer: np.ndarray
    """[slots, 1, 512] view of k_buffer's first 512 columns."""
    kv_indptr: np.ndarray
    """[B+1] int32 prefix offsets into kv_indices: 0, P_0, P_0 + P_1, ..."""
    kv_indices: np.ndarray
    """[sum P] int64 pool slots of every request's prefix tokens, in token order."""
    k_extend: np.ndarray
    """[B*T, 1, 576] the tree nodes' latents (k_buffer at out_cache_loc)."""
    v_extend: np.ndarray
    """[B*T, 1, 512] view of k_extend's first 512 columns."""
    out_cache_loc: np.ndarray
    """[B*T] int64 pool slot of each tree node (token P_b + t of request b)."""
    qo_indptr: np.ndarray
    """[B+1] int32 query row offsets: arange(0, (B+1)*T, T)."""
    custom_mask: np.ndarray
    """Full: [sum_b T*(P_b+T)] bool, request b's [T, P_b+T] row-major. Bit-packed: [B*T] uint32."""
    mask_indptr: np.ndarray
    """[B+1] int64 offset of request b's mask: cumsum of T*(P_b+T) (full) or b*T rows (bit-packed)."""
    bitpacked: bool
    """True for the one-word-per-row mask (T <= 32), False for the flat bool mask."""
    req_to_token: np.ndarray
    """[B, max_b(P_b+T)] int64 pool slot of token j of request b (past P_b+T: the padding's slots)."""
    req_pool_indices: np.ndarray
    """[B] int64 row of req_to_token per request: arange(B)."""
    scale: float
    """Softmax scale (SGLang's sm_scale)."""

    @property
    def B(self) -> int:
        return int(self.kv_indptr.shape[0]) - 1

    @property
    def T(self) -> int:
        return int(self.q.shape[0]) // max(self.B, 1)

    @property
    def H(self) -> int:
        return int(self.q.shape[1])

    def arrays(self) -> dict[str, object]:
        """Every field but the flags, by name (what from_sglang takes as a mapping, with scale)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("bitpacked",)}


def mask_indptr_full(prefix_lens: np.ndarray, T: int) -> np.ndarray:
    """[B+1] int64: 0, then cumsum of T * (P_b + T) (the full mask's per-request offsets)."""
    sizes = T * (np.asarray(prefix_lens, dtype=np.int64) + T)
    return np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)


def to_sglang(problem: Problem, bitpacked: bool = False) -> SglangBatch:
    """``problem``'s tensors in SGLang's layout; the pool is a view of problem.kv_cache (no copy)."""
    problem.validate()
    B, T, H = problem.B, problem.T, problem.H
    if bitpacked and T > MAX_BITPACKED_T:
        raise ValueError(f"the bit-packed SGLang mask holds T <= {MAX_BITPACKED_T} nodes, this problem has "
                         f"T = {T}: use the full mask (bitpacked=False)")
    P = problem.prefix_lens.astype(np.int64)
    pool = problem.kv_cache.reshape(-1, 1, DK)
    width = int((P + T).max())
    pos = np.arange(width, dtype=np.int64)
    pages = problem.block_table[:, pos // problem.page_size].astype(np.int64)
    req_to_token = pages * problem.page_size + pos % problem.page_size  # [B, width]
    kv_indices = np.concatenate([req_to_token[b, : P[b]] for b in range(B)])
    out_cache_loc = np.concatenate([req_to_token[b, P[b] : P[b] + T] for b in range(B)]).astype(np.int64)
    k_extend = pool[out_cache_loc]
    if bitpacked:
        custom_mask = np.ascontiguousarray(problem.tree_mask[:, :, 0].reshape(B * T), dtype=np.uint32)
        mask_indptr = np.arange(0, (B + 1) * T, T, dtype=np.int64)
    else:
        custom_mask = np.concatenate([_full_rows(problem, b).reshape(-1) for b in range(B)])
        mask_indptr = mask_indptr_full(P, T)
    return SglangBatch(
        q=problem.q.reshape(B * T, H, DK),
        k_buffer=pool,
        v_buffer=pool[..., :DV],
        kv_indptr=np.concatenate([[0], np.cumsum(P)]).astype(np.int32),
        kv_indices=kv_indices.astype(np.int64),
        k_extend=k_extend,
        v_extend=k_extend[..., :DV],
        out_cache_loc=out_cache_loc,
        qo_indptr=np.arange(0, (B + 1) * T, T, dtype=np.int32),
        custom_mask=custom_mask,
        mask_indptr=mask_indptr,
        bitpacked=bool(bitpacked),
        req_to_token=req_to_token,
        req_pool_indices=np.arange(B, dtype=np.int64),
        scale=float(problem.scale),
    )


def _full_rows(problem: Problem, b: int) -> np.ndarray:
    """[T, P_b + T] bool: every prefix column, then the tree's ancestor-or-self bits."""
    T, P = problem.T, int(problem.prefix_lens[b])
    bits = np.unpackbits(np.ascontiguousarray(problem.tree_mask[b], "<u4").view(np.uint8), axis=1,
                         bitorder="little")[:, :T].astype(bool)
    return np.concatenate([np.ones((T, P), bool), bits], axis=1)


def _int_array(arrays, name: str, ndim: int, length: int | None = None) -> np.ndarray:
    a = np.asarray(arrays[name])
    if a.ndim != ndim or a.dtype.kind not in "iu":
        raise ValueError(f"{name} must be a {ndim}-d integer array, got {a.ndim}-d {a.dtype}")
    if length is not None and a.shape[0] != length:
        raise ValueError(f"{name} must have {length} entries, got {a.shape[0]}")
    return a.astype(np.int64)


def _tree_words(arrays, B: int, T: int, P: np.ndarray, bitpacked: bool) -> np.ndarray:
    """[B, T, ceil(T/32)] uint32 kdtr mask words from SGLang's custom_mask (either mode)."""
    m = np.asarray(arrays["custom_mask"])
    mask_indptr = _int_array(arrays, "mask_indptr", 1, B + 1)
    if bitpacked:
        if T > MAX_BITPACKED_T:
            raise ValueError(f"an integer (bit-packed) custom_mask holds T <= {MAX_BITPACKED_T} nodes, got T = {T}")
        if m.shape != (B * T,):
            raise ValueError(f"a bit-packed custom_mask must be [B*T] = [{B * T}], got {list(m.shape)}")
        if not np.array_equal(mask_indptr, np.arange(0, (B + 1) * T, T)):
            raise ValueError("a bit-packed mask_indptr must be arange(0, (B+1)*T, T) (one word per query row)")
        words = m.view(f"u{m.dtype.itemsize}").astype(np.uint32).reshape(B, T, 1)
        if T < MASK_BITS and (words >> np.uint32(T)).any():
            raise ValueError(f"custom_mask sets bits at or above T = {T} (columns past the tree)")
        return words
    if m.dtype != np.bool_ or m.ndim != 1:
        raise ValueError(f"custom_mask must be 1-d bool (full mode) or integer (bit-packed), got {m.ndim}-d {m.dtype}")
    expect = mask_indptr_full(P, T)
    if not np.array_equal(mask_indptr, expect):
        raise ValueError("mask_indptr must be 0 then cumsum(T*(P_b+T)) of the prefix lengths from kv_indptr")
    if m.shape[0] != expect[-1]:
        raise ValueError(f"custom_mask must have sum_b T*(P_b+T) = {int(expect[-1])} entries, got {m.shape[0]}")
    words = np.zeros((B, T, -(-T // MASK_BITS)), np.uint32)
    for b in range(B):
        rows = m[expect[b] : expect[b + 1]].reshape(T, int(P[b]) + T)
        if not rows[:, : P[b]].all():
            raise ValueError(f"request {b}: custom_mask hides a prefix token; kdtr's verify sees the whole prefix")
        tree = np.zeros((T, words.shape[2] * MASK_BITS), bool)
        tree[:, :T] = rows[:, P[b] :]
        words[b] = np.packbits(tree, axis=1, bitorder="little").view("<u4")
    return words


def from_sglang(batch: SglangBatch | Mapping, T: int, H: int) -> Problem:
    """The page-size-1 Problem of SGLang's buffers: ``batch`` or a mapping with SglangBatch's field
    names (q, k_buffer, kv_indptr, kv_indices, out_cache_loc, custom_mask, mask_indptr, scale; optional
    k_extend, qo_indptr, req_to_token with req_pool_indices). An integer custom_mask is bit-packed.

    The block table is row b of req_to_token[req_pool_indices] when given, else the prefix slots then
    out_cache_loc (padded with the row's last slot). k_extend, when it differs from the pool at
    out_cache_loc, is written into a copy of the pool. Raises ValueError (one line) on bad buffers.
    """
    arrays = batch.arrays() if isinstance(batch, SglangBatch) else batch
    missing = [k for k in ("q", "k_buffer", "kv_indptr", "kv_indices", "out_cache_loc", "custom_mask",
                           "mask_indptr", "scale") if k not in arrays]
    if missing:
        raise ValueError(f"from_sglang needs {', '.join(missing)}")
    if T < 1 or H < 1:
        raise ValueError(f"T and H must be >= 1, got T = {T}, H = {H}")
    kv_indptr = _int_array(arrays, "kv_indptr", 1)
    B = kv_indptr.shape[0] - 1
    if B < 1 or kv_indptr[0] != 0 or (np.diff(kv_indptr) < 0).any():
        raise ValueError("kv_indptr must be [B+1] with B >= 1, start at 0 and never decrease")
    P = np.diff(kv_indptr)
    q, pool = np.asarray(arrays["q"]), np.asarray(arrays["k_buffer"])
    if q.shape != (B * T, H, DK):
        raise ValueError(f"q must be [B*T, H, {DK}] = [{B * T}, {H}, {DK}], got {list(q.shape)}")
    if pool.ndim != 3 or pool.shape[1:] != (1, DK):
        raise ValueError(f"k_buffer must be [slots, 1, {DK}] (page size 1), got {list(pool.shape)}")
    kv_indices = _int_array(arrays, "kv_indices", 1, int(kv_indptr[-1]))
    loc = _int_array(arrays, "out_cache_loc", 1, B * T)
    slots = np.concatenate([kv_indices, loc])
    if slots.size and (slots.min() < 0 or slots.max() >= pool.shape[0]):
        raise ValueError(f"kv_indices / out_cache_loc point outside k_buffer's {pool.shape[0]} slots")
    if "qo_indptr" in arrays and not np.array_equal(_int_array(arrays, "qo_indptr", 1, B + 1),
                                                    np.arange(0, (B + 1) * T, T)):
        raise ValueError(f"qo_indptr must be arange(0, (B+1)*T, T) for T = {T} nodes per request")
    words = _tree_words(arrays, B, T, P, np.asarray(arrays["custom_mask"]).dtype.kind in "iu")

    width = int((P + T).max())
    rows = [np.concatenate([kv_indices[kv_indptr[b] : kv_indptr[b + 1]], loc[b * T : (b + 1) * T]]) for b in range(B)]
    table = np.stack([np.pad(r, (0, width - r.size), mode="edge") for r in rows])
    if arrays.get("req_to_token") is not None:
        r2t = np.asarray(arrays["req_to_token"])
        idx = _int_array(arrays, "req_pool_indices", 1, B) if "req_pool_indices" in arrays else np.arange(B)
        if r2t.ndim != 2 or r2t.shape[1] < width or idx.min() < 0 or idx.max() >= r2t.shape[0]:
            raise ValueError(f"req_to_token must be [pool rows, >= {width}] and req_pool_indices index its rows")
        given = r2t[idx, :width].astype(np.int64)
        own = np.arange(width)[None, :] < (P + T)[:, None]
        if not np.array_equal(given[own], table[own]):
            raise ValueError("req_to_token disagrees with kv_indices / out_cache_loc on a request's own tokens")
        if given.min() < 0 or given.max() >= pool.shape[0]:
            raise ValueError(f"req_to_token points outside k_buffer's {pool.shape[0]} slots")
        table = given

    k_ext = arrays.get("k_extend")
    if k_ext is not None:
        k_ext = np.asarray(k_ext)
        if k_ext.shape != (B * T, 1, DK) or k_ext.dtype != pool.dtype:
            raise ValueError(f"k_extend must be [B*T, 1, {DK}] {pool.dtype}, got {list(k_ext.shape)} {k_ext.dtype}")
        if not _same_bits(pool[loc], k_ext):
            pool = pool.copy()
            pool[loc] = k_ext

    parent, depth = _tree_of(words, T)
    problem = Problem(q=q.reshape(B, T, H, DK), kv_cache=pool, block_table=table.astype(np.int32),
                      prefix_lens=P.astype(np.int32), tree_parent=parent, tree_depth=depth, tree_mask=words,
                      scale=float(arrays["scale"]))
    problem.validate()
    return problem


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def _tree_of(words: np.ndarray, T: int) -> tuple[np.ndarray, np.ndarray]:
    """([B, T] parent, [B, T] depth) int32 of ancestor-or-self mask words; ValueError if they are no tree.

    Node order is topological (parent < child), so a node's parent is its highest-numbered proper
    ancestor, and its depth its ancestor count.
    """
    B = words.shape[0]
    parent, depth = np.zeros((B, T), np.int32), np.zeros((B, T), np.int32)
    for b in range(B):
        vis = np.unpackbits(np.ascontiguousarray(words[b], "<u4").view(np.uint8), axis=1, bitorder="little")[:, :T]
        vis = vis.astype(bool)
        for t in range(T):
            anc = np.nonzero(vis[t, :t])[0]
            parent[b, t] = int(anc[-1]) if anc.size else -1
            depth[b, t] = anc.size
        try:
            check_tree(parent[b], depth[b], words[b])
        except TreeError as e:
            raise ValueError(f"request {b}: custom_mask is not a draft tree's ancestor mask ({e})") from None
    return parent, depth
