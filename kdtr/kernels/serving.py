"""Launching a verify kernel on a server's tensors: device addresses and a CUDA stream kdtr does not own.

kdtr's other launches run on a DeviceProblem's cupy buffers and cupy's stream. A server owns its buffers
(torch tensors), its stream and its one workspace, and captures the launch in CUDA graphs. So here a
kernel's launch plan is made once per batch size from shapes and a capacity (a ShapeProblem stands in for a
DeviceProblem: the plan never reads lengths), its tables are uploaded then, and each launch only packs
KdtrParams from the addresses it is given and enqueues on the given stream: it allocates nothing, reads no
device value and synchronises nothing, so it can be captured and replayed at other lengths. This module and
kdtr/kernels/launch.py are the only ones that reach cupy (through ``cupy_module``); kdtr/serving (torch)
sits above it.

SGLang keeps its block table as ``req_to_token[req_pool_indices]`` (token slots per request row); the
verify kernels take a block table of their own rows. GATHER_SOURCE is the small kernel that copies the
rows a batch uses into a preallocated block table before the verify launch (page ids: a page's first slot
over the page size), on the device, at every launch, so it too is graph-safe.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np

from kdtr.inputs.presets import DK
from kdtr.kernels import contract as abi
from kdtr.kernels.launch import allow_smem, external_stream, load_source, step_calls
from kdtr.kernels.launch_types import Step

GATHER_SOURCE = r"""
template <typename I>
__global__ void kdtr_gather_pages(const int* __restrict__ req_to_token, long long row_stride, int row_len,
                                  const I* __restrict__ rows, const int* __restrict__ prefix_lens, int T,
                                  int page_size, int* __restrict__ block_table, int max_pages) {
  const int b = blockIdx.y;
  const long long row = (long long)rows[b];
  int pages = (prefix_lens[b] + T + page_size - 1) / page_size;  // the pages request b reads, no more
  pages = min(pages, min(max_pages, (row_len + page_size - 1) / page_size));
  const int* src = req_to_token + row * row_stride;
  int* dst = block_table + (long long)b * max_pages;
  for (int j = blockIdx.x * blockDim.x + threadIdx.x; j < pages; j += gridDim.x * blockDim.x)
    dst[j] = src[(long long)j * page_size] / page_size;
}
"""
"""The block-table gather: row b of the block table = the pages of row rows[b] of SGLang's req_to_token."""
GATHER_THREADS = 256
GATHER_MAX_BLOCKS = 32
"""CTAs along x per request (each strides over the row)."""
PLACEHOLDER_ADDRESS = 1 << 32
"""A 16-byte-aligned address standing in for the cache while planning (the plan's tensor map is re-encoded on
the real cache at each launch)."""
PLACEHOLDER_TOKENS = 4096
"""Tokens of the stand-in cache while planning (more than a tensor-map box holds)."""


@dataclass(frozen=True)
class Buffers:
    """Device addresses and the address-dependent sizes of one launch's tensors (a server's)."""

    q: int
    """[B, T, H, 576] storage dtype."""
    kv_cache: int
    """[num_pages, page_size, 576] storage dtype."""
    block_table: int
    """[B, max_pages] int32."""
    prefix_lens: int
    """[B] int32."""
    tree_mask: int
    """[B, T, mask_words] 32-bit words."""
    out: int
    """[B, T, H, 512] out dtype."""
    lse: int
    """[B, T, H] fp32."""
    workspace: int
    """Zero-filled scratch of at least the plan's workspace bytes (0: none needed)."""
    num_pages: int
    """Pages in the cache (its tensor map's extent)."""
    max_pages: int
    """Block table row length."""


class ShapeProblem:
    """What a kernel's ``steps`` reads of a DeviceProblem, made from shapes alone (no lengths, no values)."""

    def __init__(self, B: int, T: int, H: int, max_pages: int, page_size: int, kv_dtype: str, out_dtype: str,
                 num_pages: int = 1, kv_address: int = PLACEHOLDER_ADDRESS):
        words = -(-T // 32)
        self.problem = SimpleNamespace(
            B=B, T=T, H=H, page_size=page_size, kv_dtype=kv_dtype, block_table=SimpleNamespace(shape=(B, max_pages)),
            kv_cache=SimpleNamespace(shape=(num_pages, page_size, DK)), tree_mask=SimpleNamespace(shape=(B, T, words)))
        self.out_dtype = out_dtype
        self.kv_cache = SimpleNamespace(data=SimpleNamespace(ptr=kv_address))


@dataclass
class BatchPlan:
    """One batch size's launch: the kernel's steps planned from shapes, their workspace and split count."""

    B: int
    """Requests."""
    steps: list
    """The kernel's Steps (kdtr/kernels/launch_types.py), tables uploaded."""
    workspace_bytes: int
    """Zero-filled scratch the launch needs."""
    num_splits: int
    """KdtrParams.num_splits."""


class ServingLaunch:
    """A kernel's launches for every batch size a server runs, on the server's tensors and stream."""

    def __init__(self, kernel, T: int, H: int, max_pages: int, page_size: int, kv_dtype: str, out_dtype: str,
                 scale: float):
        self.kernel, self.T, self.H, self.max_pages = kernel, T, H, max_pages
        self.page_size, self.kv_dtype, self.out_dtype, self.scale = page_size, kv_dtype, out_dtype, float(scale)
        self.plans: dict[int, BatchPlan] = {}
        self._maps: dict[tuple[int, int], np.ndarray] = {}
        self._gather = {}
        self._calls: dict[tuple, list] = {}

    def plan(self, B: int) -> BatchPlan:
        """The launch at batch ``B`` (planned, its tables uploaded and its kernels' attributes set on first use:
        call it for every batch size before capturing)."""
        if B not in self.plans:
            pages = max(1, -(-PLACEHOLDER_TOKENS // self.page_size))  # a cache any tensor-map box fits
            dp = ShapeProblem(B, self.T, self.H, self.max_pages, self.page_size, self.kv_dtype, self.out_dtype, pages)
            steps, ws, splits = self.kernel.steps(dp)
            allow_smem(steps)
            self.plans[B] = BatchPlan(B, steps, int(ws), int(splits))
        return self.plans[B]

    def gather_kernel(self, index_bytes: int):
        """The block-table gather for 4- or 8-byte row indices, loaded once."""
        if index_bytes not in self._gather:
            expr = "kdtr_gather_pages<int>" if index_bytes == 4 else "kdtr_gather_pages<long long>"
            self._gather[index_bytes] = load_source(GATHER_SOURCE, expr, "kdtr_gather_pages.cu")
        return self._gather[index_bytes]

    def gather(self, B: int, req_to_token: int, row_stride: int, row_len: int, rows: int, index_bytes: int,
               prefix_lens: int, block_table: int, stream_ptr: int) -> None:
        """Enqueue the gather of B block-table rows (addresses; ``rows`` holds ``index_bytes``-wide indices)."""
        loaded = self.gather_kernel(index_bytes)
        blocks = max(1, min(GATHER_MAX_BLOCKS, -(-self.max_pages // GATHER_THREADS)))
        args = (np.uint64(req_to_token), np.int64(row_stride), np.int32(row_len), np.uint64(rows), np.uint64(prefix_lens),
                np.int32(self.T), np.int32(self.page_size), np.uint64(block_table), np.int32(self.max_pages))
        with external_stream(stream_ptr):
            loaded.function((blocks, B, 1), (GATHER_THREADS, 1, 1), args)

    def _tensor_map(self, kv_address: int, num_pages: int) -> np.ndarray:
        """flash-sm90's cache tensor map on this cache (encoded on the host once per cache: no device work)."""
        key = (kv_address, num_pages)
        if key not in self._maps:
            from kdtr.kernels.flash import tma

            cfg = self.kernel.config()
            spec = tma.kv_map_spec(num_pages, self.page_size, DK, cfg["TMA_BOX_COLS"], cfg["BN_MT4"], cfg["TMA_BOX_SLABS"])
            self._maps[key] = tma.encode(spec, kv_address)
        return self._maps[key]

    def _args(self, step: Step, bufs: Buffers) -> tuple:
        """A step's arguments after KdtrParams, its tensor map (if any) re-encoded on this launch's cache."""
        from kdtr.kernels.flash import tma

        return tuple(self._tensor_map(bufs.kv_cache, bufs.num_pages)
                     if isinstance(a, np.ndarray) and a.dtype == tma.MAP_DTYPE else a for a in step.args)

    def _prepare(self, B: int, bufs: Buffers) -> list:
        """Callables(stream_ptr), one per step, with their arguments packed (cached per batch and addresses)."""
        key = (B, bufs)
        calls = self._calls.get(key)
        if calls is None:
            pl = self.plan(B)
            words = -(-self.T // 32)
            params = abi.as_kernel_arg(abi.pack_params(
                q=bufs.q, kv_cache=bufs.kv_cache, block_table=bufs.block_table, prefix_lens=bufs.prefix_lens,
                tree_mask=bufs.tree_mask, out=bufs.out, lse=bufs.lse, workspace=bufs.workspace, B=B, T=self.T,
                H=self.H, page_size=self.page_size, max_pages=bufs.max_pages, mask_words=words,
                num_pages=bufs.num_pages, num_splits=pl.num_splits, scale=self.scale))
            calls = step_calls(pl.steps, params, lambda s: self._args(s, bufs), external=True)
            if len(self._calls) >= 4096:  # a server's layers x batch sizes stay far below; new buffers each call do not
                self._calls.clear()
            self._calls[key] = calls
        return calls

    def launch(self, B: int, bufs: Buffers, stream_ptr: int) -> None:
        """Enqueue the verify of B requests on the stream at ``stream_ptr``: packs pointers, nothing else."""
        for call in self._prepare(B, bufs):
            call(stream_ptr)
