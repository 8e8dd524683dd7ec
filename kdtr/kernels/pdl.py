"""Programmatic dependent launch: the driver's cuLaunchKernelEx through ctypes (cupy has no launch attributes).

A launch marked dependent may be scheduled before the previous kernel of its stream has finished,
once that kernel's CTAs have all run ``griddepcontrol.launch_dependents`` (cuda/kdtr_common.cuh); the
dependent kernel's first statement, ``griddepcontrol.wait``, then holds it until the previous grid
is done and its writes are visible. What it saves is the gap between the two launches (docs/PERF.md
ledger). Only kernels that open with that wait may be launched so (kdtr/kernels/flash/kernel.py marks
them; tests/kernels/test_pdl.py checks that each does).

The structures follow cuda.h (CUDA 12+): tests/kernels/test_pdl.py checks their layout on any machine.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache

PROGRAMMATIC_STREAM_SERIALIZATION = 6
"""CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION (cuda.h)."""


class LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute: a 4-byte id, padding to 8, then a 64-byte value union (here its first int)."""

    _fields_ = [("id", ctypes.c_uint32), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int32),
                ("value_pad", ctypes.c_char * 60)]


class LaunchConfig(ctypes.Structure):
    """CUlaunchConfig."""

    _fields_ = [("grid_x", ctypes.c_uint32), ("grid_y", ctypes.c_uint32), ("grid_z", ctypes.c_uint32),
                ("block_x", ctypes.c_uint32), ("block_y", ctypes.c_uint32), ("block_z", ctypes.c_uint32),
                ("smem_bytes", ctypes.c_uint32), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(LaunchAttribute)), ("num_attrs", ctypes.c_uint32)]


@lru_cache(maxsize=1)
def _driver():
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(LaunchConfig), ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                                     ctypes.c_void_p]
    lib.cuLaunchKernelEx.restype = ctypes.c_int
    lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    return lib


def arg_buffers(args) -> list:
    """Each kernel argument as a ctypes object holding its bytes: a numpy array or record (a struct
    passed by value, e.g. KdtrParams or a tensor map) as its raw bytes, anything with a device
    pointer (``.data.ptr``) or an integer as a 64-bit value."""
    out = []
    for a in args:
        if hasattr(a, "data") and hasattr(a.data, "ptr"):  # a device array: its pointer
            out.append(ctypes.c_uint64(a.data.ptr))
        elif hasattr(a, "tobytes"):  # numpy: struct records, one-element arrays, scalars
            raw = a.tobytes()
            out.append((ctypes.c_char * len(raw)).from_buffer_copy(raw))
        else:
            out.append(ctypes.c_uint64(int(a)))
    return out


def prepare(function_ptr: int, grid, block, smem: int, args):
    """A callable(stream_ptr) that launches the kernel dependent on the stream's previous kernel
    (programmatic stream serialization); the argument bytes are packed once, here."""
    bufs = arg_buffers(args)
    params = (ctypes.c_void_p * max(1, len(bufs)))(*[ctypes.addressof(b) for b in bufs])
    attr = LaunchAttribute(id=PROGRAMMATIC_STREAM_SERIALIZATION, value=1)

    def go(stream_ptr: int) -> None:
        lib = _driver()
        cfg = LaunchConfig(*grid, *block, smem, stream_ptr, ctypes.pointer(attr), 1)
        rc = lib.cuLaunchKernelEx(ctypes.byref(cfg), function_ptr, params, None)
        if rc:
            msg = ctypes.c_char_p()
            lib.cuGetErrorString(rc, ctypes.byref(msg))
            raise RuntimeError(f"cuLaunchKernelEx: CUDA error {rc} ({(msg.value or b'?').decode()})")

    go.keep = (args, bufs, params, attr)  # the arguments (device tables too) and their bytes live as long as the launcher
    return go
