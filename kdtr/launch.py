"""Running kernels on a GPU: the only kdtr module that imports cupy.

Importing it never needs cupy; calling a GPU function without one raises ``GpuUnavailable``
with a one-line reason. CUDA kernels are compiled by ``kdtr.nvrtc`` for the device's arch and
loaded from the cached cubin; Python callables get cupy arrays (or torch tensors).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from kdtr import abi, nvrtc

CTYPES = {"fp32": "float", "bf16": "__nv_bfloat16"}
"""kdtr dtype name -> the C++ type substituted for {kv} / {out} in a name expression."""
DEFAULT_LAUNCH = (1, 128, 0, 1)
"""kdtr_launch when a .cu file defines none: {rows_per_block, threads, smem_bytes, num_splits}."""
_STATIC_SMEM_LIMIT = 48 * 1024
_BF16_NAN_BITS = 0x7FC0


class GpuUnavailable(RuntimeError):
    """No cupy or no CUDA device here."""


class KernelRuntimeError(RuntimeError):
    """A launch failed or the kernel faulted (the message is CUDA's)."""


def _cupy():
    try:
        import cupy
    except Exception as e:  # ImportError, or a broken CUDA install raising anything
        raise GpuUnavailable(f"cupy unavailable ({type(e).__name__}: {e}); pip install 'kdtr[cuda13]'") from None
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            raise GpuUnavailable("no CUDA device visible")
    except GpuUnavailable:
        raise
    except Exception as e:
        raise GpuUnavailable(f"no usable CUDA device ({type(e).__name__}: {e})") from None
    return cupy


@lru_cache(maxsize=1)
def gpu_available() -> bool:
    """True where cupy imports and sees a CUDA device (never raises)."""
    try:
        _cupy()
        return True
    except Exception:
        return False


def device_arch() -> str:
    """sm_XY of the current device."""
    cp = _cupy()
    return f"sm_{cp.cuda.Device().compute_capability}"


def device_info() -> dict:
    """Name, arch, SM count, shared-memory opt-in, L2 size and CUDA versions of the current device."""
    cp = _cupy()
    dev = cp.cuda.Device()
    props = cp.cuda.runtime.getDeviceProperties(dev.id)
    name = props["name"]
    return {
        "name": name.decode() if isinstance(name, bytes) else str(name),
        "cc": f"sm_{props['major']}{props['minor']}",
        "sm_count": int(props["multiProcessorCount"]),
        "smem_optin": int(props["sharedMemPerBlockOptin"]),
        "l2_bytes": int(props["l2CacheSize"]),
        "memory_bytes": int(props["totalGlobalMem"]),
        "driver_version": int(cp.cuda.runtime.driverGetVersion()),
        "runtime_version": int(cp.cuda.runtime.runtimeGetVersion()),
        "nvrtc_version": ".".join(map(str, nvrtc.version())) if nvrtc.available() else None,
        "cupy_version": cp.__version__,
    }


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
    out: np.ndarray
    """[B, T, H, 512] float32 (a bf16 output converted exactly; NaN kept)."""
    lse: np.ndarray | None
    """[B, T, H] float32, None for kernels that do not write it."""
    ms: float
    """Kernel time from CUDA events (Python callables: the whole call)."""


def _bits(a: np.ndarray) -> np.ndarray:
    """Storage array as uploadable raw bits: bf16 (ml_dtypes) as uint16, fp32 as is."""
    a = np.ascontiguousarray(a)
    return a.view(np.uint16) if a.dtype.itemsize == 2 else a


def _bf16_bits_to_f32(u: np.ndarray) -> np.ndarray:
    return (u.astype(np.uint32) << np.uint32(16)).view(np.float32)


class DeviceProblem:
    """A Problem's arrays on the GPU, plus out (out dtype) and lse (fp32) buffers."""

    def __init__(self, problem, out_dtype: str):
        if out_dtype not in CTYPES:
            raise ValueError(f"out dtype must be one of {', '.join(CTYPES)}, got {out_dtype!r}")
        cp = _cupy()
        problem.validate()
        self.problem, self.out_dtype = problem, out_dtype
        self.q = cp.asarray(_bits(problem.q))
        self.kv_cache = cp.asarray(_bits(problem.kv_cache))
        self.block_table = cp.asarray(np.ascontiguousarray(problem.block_table, np.int32))
        self.prefix_lens = cp.asarray(np.ascontiguousarray(problem.prefix_lens, np.int32))
        self.tree_mask = cp.asarray(np.ascontiguousarray(problem.tree_mask, np.uint32))
        self.out = cp.empty(problem.out_shape(), np.float32 if out_dtype == "fp32" else np.uint16)
        self.lse = cp.empty((problem.B, problem.T, problem.H), np.float32)

    def poison(self) -> None:
        """NaN everywhere, so that an element the kernel never writes is caught (UNWRITTEN)."""
        self.out.fill(np.nan if self.out_dtype == "fp32" else _BF16_NAN_BITS)
        self.lse.fill(np.nan)

    def params(self, workspace_ptr: int = 0, num_splits: int = 1) -> np.void:
        pr = self.problem
        return abi.pack_params(
            q=self.q.data.ptr, kv_cache=self.kv_cache.data.ptr, block_table=self.block_table.data.ptr,
            prefix_lens=self.prefix_lens.data.ptr, tree_mask=self.tree_mask.data.ptr, out=self.out.data.ptr,
            lse=self.lse.data.ptr, workspace=workspace_ptr, B=pr.B, T=pr.T, H=pr.H, page_size=pr.page_size,
            max_pages=pr.block_table.shape[1], mask_words=pr.tree_mask.shape[2], num_pages=pr.kv_cache.shape[0],
            num_splits=num_splits, scale=pr.scale,
        )

    def download(self) -> tuple[np.ndarray, np.ndarray]:
        out = self.out.get()
        return (out if self.out_dtype == "fp32" else _bf16_bits_to_f32(out)), self.lse.get()


@dataclass
class Loaded:
    function: object
    module: object
    compiled: nvrtc.Compiled
    consts: tuple[int, int, int, int]
    """kdtr_launch of the module, or DEFAULT_LAUNCH."""


_MODULES: dict[str, object] = {}


def load_function(source_path, name_expression: str, arch: str | None = None, options=()) -> Loaded:
    """Compile (or take from the cubin cache) one kernel for this device and load it."""
    cp = _cupy()
    compiled = nvrtc.compile_file(source_path, [name_expression], arch or device_arch(), options=tuple(options))
    if compiled.key not in _MODULES:
        path = compiled.path
        if path is None:  # cache not writable: a private copy
            import tempfile

            fd, tmp = tempfile.mkstemp(suffix=".cubin")
            with open(fd, "wb") as f:
                f.write(compiled.cubin)
            path = Path(tmp)
        _MODULES[compiled.key] = cp.RawModule(path=str(path))
    module = _MODULES[compiled.key]
    try:
        ptr = module.get_global("kdtr_launch")
        consts = tuple(int(x) for x in cp.ndarray((4,), cp.int32, ptr).get())
    except Exception:  # no kdtr_launch in this file (CUDA_ERROR_NOT_FOUND)
        consts = DEFAULT_LAUNCH
    return Loaded(module.get_function(compiled.lowered[name_expression]), module, compiled, consts)


def _sync(cp, what: str) -> None:
    try:
        cp.cuda.runtime.deviceSynchronize()
    except Exception as e:
        raise KernelRuntimeError(f"{what}: {e}") from e


class CudaKernel:
    """A CUDA kernel taking ``const KdtrParams``: compiled per (kv dtype, out dtype) on first use."""

    writes_lse = True

    def __init__(self, name: str, source, template: str, geometry=None, bug: int = 0, caps=None, options=()):
        self.name, self.source, self.template = name, Path(source), template
        self.geometry = geometry
        """problem -> Launch; None: the file's kdtr_launch constants (the user-kernel contract)."""
        self.bug, self.caps, self.options = int(bug), caps, tuple(options)
        self._loaded: dict[tuple[str, str], Loaded] = {}

    def name_expression(self, kv_dtype: str, out_dtype: str) -> str:
        t = self.template.replace("{kv}", CTYPES[kv_dtype]).replace("{out}", CTYPES[out_dtype])
        return t.replace("{bug}", str(self.bug))

    def load(self, kv_dtype: str, out_dtype: str) -> Loaded:
        key = (kv_dtype, out_dtype)
        if key not in self._loaded:
            self._loaded[key] = load_function(self.source, self.name_expression(kv_dtype, out_dtype), options=self.options)
        return self._loaded[key]

    def run(self, problem, out_dtype: str) -> RunOutput:
        return self.run_on(DeviceProblem(problem, out_dtype))

    def run_on(self, dp: DeviceProblem) -> RunOutput:
        """Poison, launch once, synchronize, download (inputs already on the GPU)."""
        cp = _cupy()
        loaded = self.load(dp.problem.kv_dtype, dp.out_dtype)
        launch = self.geometry(dp.problem) if self.geometry else launch_from_constants(dp.problem, loaded.consts)
        if launch.smem_bytes > _STATIC_SMEM_LIMIT:
            loaded.function.max_dynamic_shared_size_bytes = launch.smem_bytes
        ws = cp.zeros(launch.workspace_bytes, cp.uint8) if launch.workspace_bytes else None
        arg = abi.as_kernel_arg(dp.params(ws.data.ptr if ws is not None else 0, launch.num_splits))
        dp.poison()
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        try:
            start.record()
            loaded.function(launch.grid, launch.block, (arg,), shared_mem=launch.smem_bytes)
            stop.record()
        except Exception as e:
            raise KernelRuntimeError(f"{self.name}: launch {launch} failed: {e}") from e
        _sync(cp, self.name)
        out, lse = dp.download()
        return RunOutput(out, lse, float(cp.cuda.get_elapsed_time(start, stop)))


class PyCallableKernel:
    """A Python callable ``fn(q, kv_cache, block_table, prefix_lens, tree_mask, *, scale, page_size,
    out_dtype)`` returning out or (out, lse), on cupy arrays, or torch tensors when
    ``fn.kdtr_framework == "torch"``. bf16 arrives as raw uint16 bits (cupy) or torch.bfloat16;
    out_dtype is "fp32" or "bf16"; the tree mask is int32 for torch (torch lacks uint32 ops).
    """

    def __init__(self, fn, name: str, caps=None):
        self.fn, self.name = fn, name
        self.framework = getattr(fn, "kdtr_framework", "cupy")
        self.caps = getattr(fn, "kdtr_caps", None) or caps
        self.writes_lse = bool(getattr(fn, "kdtr_writes_lse", True))

    def run(self, problem, out_dtype: str) -> RunOutput:
        cp = _cupy()
        dp = DeviceProblem(problem, out_dtype)
        args = [dp.q, dp.kv_cache, dp.block_table, dp.prefix_lens, dp.tree_mask]
        bf16 = problem.kv_dtype == "bf16"
        if self.framework == "torch":
            import torch

            args = [
                torch.from_dlpack(a.view(cp.int16)).view(torch.bfloat16) if (i < 2 and bf16)
                else torch.from_dlpack(a.view(cp.int32) if a.dtype == cp.uint32 else a)
                for i, a in enumerate(args)
            ]
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        try:
            res = self.fn(*args, scale=float(problem.scale), page_size=problem.page_size, out_dtype=out_dtype)
            if self.framework == "torch":
                torch.cuda.synchronize()
        except Exception as e:
            raise KernelRuntimeError(f"{self.name}: {type(e).__name__}: {e}") from e
        stop.record()
        _sync(cp, self.name)
        out, lse = res if isinstance(res, (tuple, list)) else (res, None)
        return RunOutput(
            _to_f32(out), None if lse is None else _to_f32(lse),
            float(cp.cuda.get_elapsed_time(start, stop)),
        )


def _to_f32(x) -> np.ndarray:
    """A cupy array / torch tensor / numpy array as numpy float32 (uint16/int16: bf16 bits)."""
    if hasattr(x, "detach"):  # torch
        return x.detach().float().cpu().numpy()
    a = x.get() if hasattr(x, "get") and not isinstance(x, np.ndarray) else np.asarray(x)
    if a.dtype in (np.uint16, np.int16) or a.dtype.name == "bfloat16":
        return _bf16_bits_to_f32(a.view(np.uint16))
    return a.astype(np.float32)


__all__ = [
    "CTYPES", "CudaKernel", "DeviceProblem", "GpuUnavailable", "KernelRuntimeError", "Launch", "Loaded",
    "PyCallableKernel", "RunOutput", "device_arch", "device_info", "gpu_available", "launch_from_constants",
    "load_function",
]
