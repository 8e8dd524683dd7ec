"""Hopper tensor maps (TMA descriptors) of the KV cache, encoded by the CUDA driver.

flash-sm90 copies each full prefix tile with one ``cp.async.bulk.tensor`` box, laid out and
swizzled by the copy engine as the kernel's stages want it (cuda/flash_sm90.cu). The engine
needs a 128-byte ``CUtensorMap`` built on the host by ``cuTensorMapEncodeTiled``; it travels to
the kernel by value as a second parameter. The spec below is pure arithmetic (tested without a
GPU); ``encode`` calls the driver through ctypes, so neither this module nor its callers need
cuda-python. Only the launch layer's callers reach it, and only on a GPU.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

MAP_BYTES = 128
"""sizeof(CUtensorMap); the kernel's KvTensorMap is the same 16 x u64, 64-byte aligned."""
MAP_DTYPE = np.dtype([("opaque", "<u8", (16,))])
"""One map as a kernel argument: cupy passes a size-1 numpy array by value."""

# cuda.h enum values (CUtensorMapDataType, ...Interleave, ...Swizzle, ...L2promotion, ...FloatOOBfill)
DATA_TYPE_BFLOAT16 = 9
INTERLEAVE_NONE = 0
SWIZZLE_128B = 3
L2_PROMOTION_128B = 2
L2_PROMOTION = L2_PROMOTION_128B
"""The cache map's L2 promotion (CUtensorMapL2promotion): the bytes an L2 miss of a box fetches. A box reads
each key's 128-byte slab rows slab by slab (1152 bytes apart), and 256-byte promotion made a bare stream of
such boxes 7-8 % slower than 128 bytes, 64 or none (equal), and the all-transposed decode 5-8 % slower."""
OOB_FILL_ZEROS = 0
SWIZZLE_128B_ROW_BYTES = 128


class TmaUnavailable(RuntimeError):
    """No CUDA driver with cuTensorMapEncodeTiled here, or the driver refused the map."""


@dataclass(frozen=True)
class KvMapSpec:
    """A rank-3 tiled map over the cache: (slab columns, slots, slabs), the slab dimension outermost
    with a 128-byte stride, so one box is a whole tile laid out slab by slab as the kernel keeps it."""

    dims: tuple[int, int, int]
    """Elements per dimension, innermost first: (64, slots, 9)."""
    strides: tuple[int, int]
    """Bytes to the next slot and to the next slab: (1152, 128)."""
    box: tuple[int, int, int]
    """Elements one copy brings in, per dimension: (64, BN, 9)."""
    elem_bytes: int = 2
    """bf16."""

    def __post_init__(self):
        if len(self.dims) != 3 or len(self.box) != 3 or len(self.strides) != 2:
            raise ValueError(f"tensor map rank: dims {self.dims}, strides {self.strides}, box {self.box} disagree")
        cols, rows, slabs = self.dims
        if cols < 1 or rows < 1 or rows >= 2**31:
            raise ValueError(f"tensor map dims {self.dims}: need 1 <= columns and 1 <= rows < 2^31")
        if any(st % 16 for st in self.strides) or self.strides[0] < cols * self.elem_bytes:
            raise ValueError(f"strides {self.strides} B: must be multiples of 16, the first covering a row")
        if self.box[0] * self.elem_bytes != SWIZZLE_128B_ROW_BYTES:
            raise ValueError(f"box of {self.box[0]} columns: a 128-byte swizzle needs 128-byte box rows")
        if not all(1 <= b <= 256 for b in self.box[1:]) or cols % self.box[0] or slabs % self.box[2]:
            raise ValueError(f"box {self.box}: rows 1..256 and whole boxes across {self.dims}")


def kv_map_spec(num_pages: int, page_size: int, dk: int, box_cols: int, box_rows: int, box_slabs: int) -> KvMapSpec:
    """The rank-3 map of a bf16 cache [num_pages, page_size, dk] seen as box_cols-wide slabs: a box
    is box_rows slots x box_slabs slabs, laid out slab by slab (flash-sm90's stage layout)."""
    if dk % box_cols:
        raise ValueError(f"{dk} columns do not split into {box_cols}-column slabs")
    return KvMapSpec((box_cols, num_pages * page_size, dk // box_cols), (dk * 2, box_cols * 2),
                     (box_cols, box_rows, box_slabs))


@lru_cache(maxsize=1)
def _encode_fn():
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        fn = lib.cuTensorMapEncodeTiled
    except (OSError, AttributeError) as e:
        raise TmaUnavailable(f"no cuTensorMapEncodeTiled in the CUDA driver ({e})") from None
    u32, u64 = ctypes.c_uint32, ctypes.c_uint64
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, u32, ctypes.c_void_p, ctypes.POINTER(u64), ctypes.POINTER(u64),
                   ctypes.POINTER(u32), ctypes.POINTER(u32), ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def encode(spec: KvMapSpec, address: int) -> np.ndarray:
    """The CUtensorMap of ``spec`` over device memory at ``address``, as a kernel argument."""
    if address % 16:
        raise TmaUnavailable(f"cache address {address:#x} is not 16-byte aligned")
    fn = _encode_fn()
    raw = np.zeros(MAP_BYTES + 64, np.uint8)  # the driver wants the map 64-byte aligned
    start = -raw.ctypes.data % 64
    u32, u64, rank = ctypes.c_uint32, ctypes.c_uint64, 3
    rc = fn(raw.ctypes.data + start, DATA_TYPE_BFLOAT16, rank, address, (u64 * rank)(*spec.dims),
            (u64 * (rank - 1))(*spec.strides), (u32 * rank)(*spec.box), (u32 * rank)(*([1] * rank)), INTERLEAVE_NONE,
            SWIZZLE_128B, L2_PROMOTION, OOB_FILL_ZEROS)
    if rc != 0:
        raise TmaUnavailable(f"cuTensorMapEncodeTiled refused {spec} (CUresult {rc})")
    out = np.zeros(1, MAP_DTYPE)
    out.view(np.uint8)[:] = raw[start:start + MAP_BYTES]
    return out
