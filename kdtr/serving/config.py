"""What a TreeVerify is made for, and the checks of a launch's tensors: shapes and dtypes only, no torch import
and no device, so the fake (meta) implementation of the custom op runs the same checks as the real one, and
bad input is one InputError line on any machine."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from kdtr.errors import InputError
from kdtr.inputs.presets import DK, DV

DTYPES = ("bf16", "fp32")
"""Storage (q, cache) and output dtypes."""
KERNELS = ("flash-sm90", "flash", "naive")
"""Kernels a TreeVerify can launch: the default is flash-sm90 on sm_90, flash elsewhere; naive for fp32 storage."""
MAX_T = 1280
"""Most tree nodes per request (the flash kernels' MAX_T; kdtr/kernels/registry.py FLASH_CAPS)."""
TORCH_DTYPES = {"bf16": "torch.bfloat16", "fp32": "torch.float32"}
"""kdtr dtype -> str(torch dtype)."""
WORD_DTYPES = ("torch.int32", "torch.uint32")
"""Tree-mask words: 32 bits each, either signedness."""
INDEX_DTYPES = ("torch.int32", "torch.int64")
"""req_pool_indices: SGLang's are int64."""


@dataclass(frozen=True)
class VerifyConfig:
    """A verify launch's fixed shapes, checked here; everything a launch may vary (batch up to max_batch, lengths,
    trees, which layer's cache) arrives as tensors."""

    T: int
    """Tree nodes per request (root + budget)."""
    H: int
    """Query heads on this GPU."""
    max_batch: int
    """Most requests one launch takes (the server's largest padded batch)."""
    max_context: int
    """Most tokens of one request, prefix and tree (the server's context length): sizes the block table
    (ceil(max_context / page_size) pages) and the plan's capacity."""
    page_size: int
    """Tokens per cache page (1: SGLang's token pool)."""
    scale: float
    """Softmax scale of q.k (the model's, e.g. DeepSeek-V3's 0.1352)."""
    out_dtype: str = "bf16"
    """"bf16" or "fp32"."""
    kv_dtype: str = "bf16"
    """Storage of q and the cache: "bf16" (flash kernels) or "fp32" (the naive kernel)."""
    arch: str | None = None
    """sm_XY (or sm_90a) the server expects; None: the device's. A different device is an error, not a slow path."""
    kernel: str | None = None
    """One of KERNELS; None: flash-sm90 on sm_90, flash elsewhere (naive for fp32 storage)."""
    batch_sizes: tuple[int, ...] | None = None
    """The batch sizes launches will use (a server's CUDA-graph sizes), planned up front; None: 1..max_batch."""

    def __post_init__(self):
        for name in ("T", "H", "max_batch", "max_context", "page_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise InputError(f"TreeVerify: {name} must be a positive int, got {v!r}")
        if self.T > MAX_T:
            raise InputError(f"TreeVerify: T={self.T} tree nodes; the kernels take at most {MAX_T}")
        if self.max_context < self.T:
            raise InputError(f"TreeVerify: max_context={self.max_context} is shorter than the tree (T={self.T}); "
                             "it counts the prefix and the tree")
        if isinstance(self.scale, bool) or not isinstance(self.scale, (int, float)) or not (
                math.isfinite(self.scale) and self.scale > 0):
            raise InputError(f"TreeVerify: scale must be a positive finite float, got {self.scale!r}")
        for name in ("out_dtype", "kv_dtype"):
            if getattr(self, name) not in DTYPES:
                raise InputError(f"TreeVerify: {name} must be one of {', '.join(DTYPES)}, got {getattr(self, name)!r}")
        if self.arch is not None and not (isinstance(self.arch, str) and re.fullmatch(r"sm_\d+a?", self.arch)):
            raise InputError(f"TreeVerify: arch must be like 'sm_90' or 'sm_90a', got {self.arch!r}")
        if self.kernel is not None and self.kernel not in KERNELS:
            raise InputError(f"TreeVerify: kernel must be one of {', '.join(KERNELS)}, got {self.kernel!r}")
        if self.kernel in ("flash", "flash-sm90") and self.kv_dtype != "bf16":
            raise InputError(f"TreeVerify: {self.kernel} reads bf16 storage; fp32 storage takes kernel='naive'")
        if self.batch_sizes is not None:
            bad = [b for b in self.batch_sizes if isinstance(b, bool) or not isinstance(b, int)
                   or not 1 <= b <= self.max_batch]
            if not self.batch_sizes or bad:
                raise InputError(f"TreeVerify: batch_sizes must be ints in 1..max_batch={self.max_batch}, "
                                 f"got {list(self.batch_sizes)!r}")

    @property
    def max_pages(self) -> int:
        """Block-table row length: the pages of the longest request."""
        return -(-self.max_context // self.page_size)

    @property
    def mask_words(self) -> int:
        return -(-self.T // 32)

    @property
    def sizes(self) -> tuple[int, ...]:
        """The batch sizes planned, ascending."""
        return tuple(sorted(set(self.batch_sizes))) if self.batch_sizes else tuple(range(1, self.max_batch + 1))

    def kernel_for(self, arch: str) -> str:
        """The kernel to launch on a device of ``arch``."""
        if self.kernel:
            return self.kernel
        if self.kv_dtype == "fp32":
            return "naive"
        return "flash-sm90" if arch.startswith("sm_90") else "flash"


def workspace_table(sizes, bytes_of) -> dict[int, int]:
    """{batch: bytes} where each entry is the most any planned batch size up to it needs (``bytes_of(b)``): one
    workspace of ``table[max]`` bytes serves every launch, and a smaller batch never needs more than a larger."""
    table, most = {}, 0
    for b in sorted(sizes):
        most = max(most, int(bytes_of(b)))
        table[b] = most
    return table


@dataclass(frozen=True)
class LaunchShape:
    """What check_tensors read off a launch's tensors."""

    B: int
    """Requests of this launch (from q)."""
    num_pages: int
    """Pages in the cache."""
    max_pages: int
    """Block-table row length (req_to_token's when gathering)."""


def check_tensors(cfg: VerifyConfig, q, kv_cache, block_table, prefix_lens, tree_mask, out, lse, workspace,
                  req_pool_indices=None) -> LaunchShape:
    """InputError (one line, naming the tensor) unless the tensors fit ``cfg``; reads shapes, strides and dtypes
    only (works on fake tensors, reads no device value)."""
    kv_t, out_t = TORCH_DTYPES[cfg.kv_dtype], TORCH_DTYPES[cfg.out_dtype]
    rows = cfg.T * cfg.H

    def need(ok: bool, what: str) -> None:
        if not ok:
            raise InputError(f"TreeVerify.run: {what}")

    for name, t in (("q", q), ("kv_cache", kv_cache), ("block_table", block_table), ("prefix_lens", prefix_lens),
                    ("tree_mask", tree_mask), ("out", out), ("lse", lse), ("workspace", workspace)):
        need(t.is_contiguous() or (name == "block_table" and req_pool_indices is not None and t.stride(-1) == 1),
             f"{name} must be contiguous")
    need(str(q.dtype) == kv_t and q.shape[-1] == DK and q.dim() in (3, 4) and q.numel() % (rows * DK) == 0,
         f"q must be [B*T, H, {DK}] or [B, T, H, {DK}] {kv_t} with T={cfg.T}, H={cfg.H}; got {list(q.shape)} {q.dtype}")
    B = q.numel() // (rows * DK)
    need(1 <= B <= cfg.max_batch, f"q holds {B} requests; this TreeVerify takes 1..{cfg.max_batch}")
    need(q.shape[-2] == cfg.H, f"q has {q.shape[-2]} heads, expected H={cfg.H}")
    need(str(kv_cache.dtype) == kv_t and kv_cache.shape[-1] == DK and kv_cache.numel() % (cfg.page_size * DK) == 0,
         f"kv_cache must be [slots, 1, {DK}] or [pages, {cfg.page_size}, {DK}] {kv_t}; got {list(kv_cache.shape)} "
         f"{kv_cache.dtype}")
    num_pages = kv_cache.numel() // (cfg.page_size * DK)
    need(num_pages >= 1, "kv_cache is empty")
    need(str(block_table.dtype) == "torch.int32" and block_table.dim() == 2,
         f"block_table must be 2-D int32; got {list(block_table.shape)} {block_table.dtype}")
    if req_pool_indices is None:
        need(block_table.shape[0] >= B, f"block_table has {block_table.shape[0]} rows for {B} requests")
    else:
        need(str(req_pool_indices.dtype) in INDEX_DTYPES and req_pool_indices.dim() == 1
             and req_pool_indices.is_contiguous() and req_pool_indices.shape[0] >= B,
             f"req_pool_indices must be a contiguous 1-D int32 or int64 of at least {B} entries; got "
             f"{list(req_pool_indices.shape)} {req_pool_indices.dtype}")
    need(str(prefix_lens.dtype) == "torch.int32" and prefix_lens.dim() == 1 and prefix_lens.shape[0] >= B,
         f"prefix_lens must be 1-D int32 of at least {B} entries; got {list(prefix_lens.shape)} {prefix_lens.dtype}")
    need(str(tree_mask.dtype) in WORD_DTYPES and tree_mask.shape[-1] == cfg.mask_words
         and tree_mask.numel() >= B * cfg.T * cfg.mask_words,
         f"tree_mask must be [B, T, {cfg.mask_words}] int32 words; got {list(tree_mask.shape)} {tree_mask.dtype}")
    need(str(out.dtype) == out_t and out.shape[-1] == DV and out.numel() == B * rows * DV,
         f"out must be [B*T, H, {DV}] {out_t} for {B} requests; got {list(out.shape)} {out.dtype}")
    need(str(lse.dtype) == "torch.float32" and lse.numel() == B * rows,
         f"lse must be [B*T, H] torch.float32 for {B} requests; got {list(lse.shape)} {lse.dtype}")
    max_pages = block_table.shape[1] if req_pool_indices is None else cfg.max_pages
    return LaunchShape(B, num_pages, max_pages)
