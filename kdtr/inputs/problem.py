"""The operator's inputs as a server lays them out (SPEC sections 1 and 3).

A ``Problem`` is what every implementation consumes: the numpy reference, the CPU flash
emulation, the CUDA launcher and Python-callable kernels. Bundles store exactly these arrays.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kdtr.inputs.presets import DK, DV, dtype_of

MASK_BITS = 32


def mask_words(T: int) -> int:
    """uint32 words per packed mask row."""
    return (T + MASK_BITS - 1) // MASK_BITS


def visible_flops(prefix_lens: np.ndarray, depth: np.ndarray, H: int) -> int:
    """2 * H * sum_b sum_t (P_b + depth[b, t] + 1) * (576 + 512).  depth: [B, T]."""
    T = depth.shape[1]
    pairs = int(prefix_lens.astype(np.int64).sum()) * T + int((depth.astype(np.int64) + 1).sum())
    return 2 * H * pairs * (DK + DV)


@dataclass
class Problem:
    """One verify launch: B requests, each a committed prefix plus a T-node draft tree."""

    q: np.ndarray
    """[B, T, H, 576] queries, storage dtype (float32 or bfloat16)."""
    kv_cache: np.ndarray
    """[num_pages, page_size, 576] paged latent cache; V is columns 0:512. Unowned slots are NaN."""
    block_table: np.ndarray
    """[B, max_pages] int32 page ids; entries past a request's last page point at a NaN page."""
    prefix_lens: np.ndarray
    """[B] int32 committed prefix length P_b; request b owns tokens 0 .. P_b + T - 1."""
    tree_parent: np.ndarray
    """[B, T] int32 parent node index, -1 for the root (node 0)."""
    tree_depth: np.ndarray
    """[B, T] int32 depth of each node (root 0)."""
    tree_mask: np.ndarray
    """[B, T, ceil(T/32)] uint32: bit c%32 of word c//32 in row r set iff node r sees node c."""
    scale: float
    """Softmax scale applied to q.k (never 576**-0.5 by default: it is the model's)."""

    @property
    def B(self) -> int:
        return int(self.q.shape[0])

    @property
    def T(self) -> int:
        return int(self.q.shape[1])

    @property
    def H(self) -> int:
        return int(self.q.shape[2])

    @property
    def page_size(self) -> int:
        return int(self.kv_cache.shape[1])

    @property
    def kv_dtype(self) -> str:
        """Storage dtype name ("fp32" or "bf16") of q and the cache."""
        from kdtr.inputs.presets import dtype_name

        return dtype_name(self.kv_cache.dtype)

    def validate(self) -> None:
        """Raise ValueError naming the first inconsistency between the arrays."""
        B, T, H = self.q.shape[:3]
        if self.q.ndim != 4 or self.q.shape[3] != DK:
            raise ValueError(f"q must be [B, T, H, {DK}], got {list(self.q.shape)}")
        if self.kv_cache.ndim != 3 or self.kv_cache.shape[2] != DK:
            raise ValueError(f"kv_cache must be [pages, page_size, {DK}], got {list(self.kv_cache.shape)}")
        if self.q.dtype != self.kv_cache.dtype:
            raise ValueError(f"q dtype {self.q.dtype} differs from kv_cache dtype {self.kv_cache.dtype}")
        dtype_of(self.kv_dtype)  # raises on an unsupported storage dtype
        expect = {
            "block_table": (2, np.int32),
            "prefix_lens": (1, np.int32),
            "tree_parent": (2, np.int32),
            "tree_depth": (2, np.int32),
            "tree_mask": (3, np.uint32),
        }
        for name, (ndim, dt) in expect.items():
            a = getattr(self, name)
            if a.ndim != ndim or a.dtype != dt:
                raise ValueError(f"{name} must be {ndim}-d {np.dtype(dt).name}, got {a.ndim}-d {a.dtype}")
        if self.block_table.shape[0] != B or self.prefix_lens.shape != (B,):
            raise ValueError("block_table / prefix_lens batch size differs from q")
        if self.tree_parent.shape != (B, T) or self.tree_depth.shape != (B, T):
            raise ValueError(f"tree_parent / tree_depth must be [{B}, {T}]")
        if self.tree_mask.shape != (B, T, mask_words(T)):
            raise ValueError(f"tree_mask must be [{B}, {T}, {mask_words(T)}], got {list(self.tree_mask.shape)}")
        if (self.prefix_lens < 0).any():
            raise ValueError("prefix_lens must be >= 0")
        need = -(-(self.prefix_lens.astype(np.int64) + T) // self.page_size)
        if (need > self.block_table.shape[1]).any():
            raise ValueError("block_table has fewer pages than P_b + T needs")
        owned = self.block_table[np.arange(self.block_table.shape[1])[None, :] < need[:, None]]
        if owned.size and (owned.min() < 0 or owned.max() >= self.kv_cache.shape[0]):
            raise ValueError("block_table points outside kv_cache")
        if not np.isfinite(self.scale) or self.scale <= 0:
            raise ValueError(f"scale must be a positive finite number, got {self.scale}")

    def tokens(self, b: int) -> np.ndarray:
        """[P_b + T] cache slot ids (page * page_size + offset) of request b, in token order."""
        n = int(self.prefix_lens[b]) + self.T
        pos = np.arange(n, dtype=np.int64)
        pages = self.block_table[b, pos // self.page_size].astype(np.int64)
        return pages * self.page_size + pos % self.page_size

    def gather_kv(self, b: int, start: int, stop: int) -> np.ndarray:
        """[stop - start, 576] float64 latent rows of request b's tokens start..stop-1 as stored."""
        slots = self.tokens(b)[start:stop]
        flat = self.kv_cache.reshape(-1, DK)
        return flat[slots].astype(np.float64)

    def out_shape(self) -> tuple[int, int, int, int]:
        return (self.B, self.T, self.H, DV)
