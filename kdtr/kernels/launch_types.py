"""What a launch is and what it gives back: geometry, outputs, storage bits. No GPU needed.

Split from kdtr/kernels/launch.py (the layer that talks to cupy), so that the launch contract of
kdtr_abi.h and the bf16 bit conversions are plain numpy and testable anywhere.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from kdtr.kernels import contract as abi

CTYPES = {"fp32": "float", "bf16": "__nv_bfloat16"}
"""kdtr dtype name -> the C++ type substituted for {kv} / {out} in a name expression."""
DEFAULT_LAUNCH = (1, 128, 0, 1)
"""kdtr_launch when a .cu file defines none: {rows_per_block, threads, smem_bytes, num_splits}."""


class KernelRuntimeError(RuntimeError):
    """A launch failed or the kernel faulted (the message is CUDA's)."""


class CaptureError(RuntimeError):
    """A kernel's launch could not be captured into a CUDA graph: it allocated, synchronised, copied to
    or from the host, or did anything else stream capture refuses (the message says what CUDA said)."""


@dataclass(frozen=True)
class Launch:
    """How to launch one kernel on one problem."""

    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    smem_bytes: int = 0
    """Dynamic shared memory per block."""
    workspace_bytes: int = 0
    """Zero-filled scratch handed to the kernel as p.workspace (0: null)."""
    num_splits: int = 1
    """p.num_splits: the split-KV partitions the workspace holds."""


@dataclass(frozen=True)
class Step:
    """One kernel launch of a run: kdtr/kernels/launch.py's make_launcher enqueues a kernel's steps in order,
    each with the run's one KdtrParams first."""

    loaded: object
    """The compiled, loaded kernel (kdtr/kernels/launch.py's Loaded; not imported here, which would make an import
    cycle); its ``dependent`` flag asks for a dependent launch."""
    grid: tuple[int, int, int]
    """CTAs along x, y, z."""
    block: tuple[int, int, int]
    """Threads per CTA along x, y, z."""
    smem: int = 0
    """Dynamic shared memory per CTA, bytes."""
    args: tuple = ()
    """Arguments after KdtrParams, by value or device arrays (e.g. flash-sm90's tensor map and the plan's FlashSched)."""
    keep: tuple = ()
    """Device buffers the arguments point into (e.g. the plan's split table): the launcher holds them."""


INPUTS = ("q", "kv_cache", "block_table", "prefix_lens", "tree_mask")
"""The input buffers a server writes before every replay of a captured launch (DeviceProblem.upload, and its host
twin kdtr.kernels.emulate.HostBuffers.upload)."""


def check_upload(have: dict, new: dict) -> None:
    """ValueError, naming the first, where an input of ``new`` differs in shape or dtype from the buffer of
    ``have`` it is to be written into (name -> array, for each of INPUTS): a captured launch takes inputs of
    its own shapes only."""
    for name in INPUTS:
        a, b = have[name], new[name]
        if a.shape != b.shape or a.dtype != b.dtype:
            raise ValueError(f"{name}: the buffers hold {list(a.shape)} {a.dtype}, the problem "
                             f"{list(b.shape)} {b.dtype}; a captured launch takes inputs of its own shapes only")


def launch_from_constants(problem, consts) -> Launch:
    """The user-kernel contract of kdtr_abi.h: grid (ceil(T*H / rows_per_block), B, num_splits)."""
    rows_per_block, threads, smem, splits = (int(x) for x in consts)
    if rows_per_block < 1 or not 1 <= threads <= 1024 or smem < 0 or splits < 1:
        raise KernelRuntimeError(f"bad kdtr_launch {{{rows_per_block}, {threads}, {smem}, {splits}}}")
    rows = problem.T * problem.H
    return Launch(
        grid=(math.ceil(rows / rows_per_block), problem.B, splits), block=(threads, 1, 1), smem_bytes=smem,
        workspace_bytes=abi.workspace_bytes(problem.B, problem.T, problem.H, splits), num_splits=splits,
    )


@dataclass
class RunOutput:
    """What one run of a kernel gave back, on the host."""

    out: np.ndarray
    """[B, T, H, 512] float32 (a bf16 output converted exactly; NaN kept)."""
    lse: np.ndarray | None
    """[B, T, H] float32, None for kernels that do not write it."""
    ms: float
    """Kernel time from CUDA events (Python callables: the whole call)."""


def storage_bits(a: np.ndarray) -> np.ndarray:
    """Storage array as uploadable raw bits: bf16 (ml_dtypes) as uint16, fp32 as is."""
    a = np.ascontiguousarray(a)
    return a.view(np.uint16) if a.dtype.itemsize == 2 else a


def bf16_bits_to_f32(u: np.ndarray) -> np.ndarray:
    return (u.astype(np.uint32) << np.uint32(16)).view(np.float32)


def to_f32(x) -> np.ndarray:
    """A cupy array / torch tensor / numpy array as numpy float32 (uint16/int16: bf16 bits)."""
    if hasattr(x, "detach"):  # torch
        return x.detach().float().cpu().numpy()
    a = x.get() if hasattr(x, "get") and not isinstance(x, np.ndarray) else np.asarray(x)
    if a.dtype in (np.uint16, np.int16) or a.dtype.name == "bfloat16":
        return bf16_bits_to_f32(a.view(np.uint16))
    return a.astype(np.float32)
