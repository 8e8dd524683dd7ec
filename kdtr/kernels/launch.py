"""Running kernels on a GPU: the only kdtr module that imports cupy.

Importing it never needs cupy; calling a GPU function without one raises ``GpuUnavailable``
with a one-line reason. CUDA kernels are compiled by kdtr/kernels/nvrtc.py for the device's arch and
loaded from the cached cubin; Python callables get cupy arrays (or torch tensors).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from kdtr.kernels import contract as abi, nvrtc
from kdtr.kernels.bugs import Bug, kernel_bug
from kdtr.kernels.contract import POISON_BF16_BITS, POISON_F32_BITS
from kdtr.kernels.launch_types import (  # re-exported: kdtr.kernels.launch stays the one import for callers
    CTYPES, DEFAULT_LAUNCH, INPUTS, CaptureError, KernelRuntimeError, Launch, RunOutput, Step, bf16_bits_to_f32,
    check_upload, storage_bits, launch_from_constants,
)

_STATIC_SMEM_LIMIT = 48 * 1024


class GpuUnavailable(RuntimeError):
    """No cupy or no CUDA device here."""


def cupy_module():
    """cupy, once a GPU is known to be usable: the one import of cupy in kdtr (GpuUnavailable otherwise)."""
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
        cupy_module()
        return True
    except Exception:
        return False


def gpu_unavailable_reason() -> str | None:
    """Why there is no usable GPU here (one line), or None when there is one."""
    try:
        cupy_module()
        return None
    except GpuUnavailable as e:
        return str(e)


def device_arch() -> str:
    """sm_XY of the current device."""
    cp = cupy_module()
    return f"sm_{cp.cuda.Device().compute_capability}"


@lru_cache(maxsize=1)
def device_info() -> dict:
    """Name, arch, SM count, an SM's limits (shared memory, the per-CTA opt-in, registers, threads, CTAs), L2 size
    and CUDA versions of the current device."""
    cp = cupy_module()
    dev = cp.cuda.Device()
    props = cp.cuda.runtime.getDeviceProperties(dev.id)
    name = props["name"]
    return {
        "name": name.decode() if isinstance(name, bytes) else str(name),
        "cc": f"sm_{props['major']}{props['minor']}",
        "sm_count": int(props["multiProcessorCount"]),
        "smem_optin": int(props["sharedMemPerBlockOptin"]),
        "smem_per_sm": int(props["sharedMemPerMultiprocessor"]),
        "regs_per_sm": int(props["regsPerMultiprocessor"]),
        "threads_per_sm": int(props.get("maxThreadsPerMultiProcessor", 2048)),
        "ctas_per_sm": int(props.get("maxBlocksPerMultiProcessor", 32)),
        "l2_bytes": int(props["l2CacheSize"]),
        "memory_bytes": int(props["totalGlobalMem"]),
        "driver_version": int(cp.cuda.runtime.driverGetVersion()),
        "runtime_version": int(cp.cuda.runtime.runtimeGetVersion()),
        "nvrtc_version": ".".join(map(str, nvrtc.version())) if nvrtc.available() else None,
        "cupy_version": cp.__version__,
    }


class DeviceProblem:
    """A Problem's arrays on the GPU, plus out (out dtype) and lse (fp32) buffers."""

    def __init__(self, problem, out_dtype: str):
        if out_dtype not in CTYPES:
            raise ValueError(f"out dtype must be one of {', '.join(CTYPES)}, got {out_dtype!r}")
        cp = cupy_module()
        problem.validate()
        self.problem, self.out_dtype = problem, out_dtype
        self.q = cp.asarray(storage_bits(problem.q))
        self.kv_cache = cp.asarray(storage_bits(problem.kv_cache))
        self.block_table = cp.asarray(np.ascontiguousarray(problem.block_table, np.int32))
        self.prefix_lens = cp.asarray(np.ascontiguousarray(problem.prefix_lens, np.int32))
        self.tree_mask = cp.asarray(np.ascontiguousarray(problem.tree_mask, np.uint32))
        self.out = cp.empty(problem.out_shape(), np.float32 if out_dtype == "fp32" else np.uint16)
        self.lse = cp.empty((problem.B, problem.T, problem.H), np.float32)

    def with_tree(self, tree) -> "DeviceProblem":
        """This problem's q, cache, block table and prefix lengths (the same device buffers, not copies) under
        ``tree`` (a kdtr.inputs.trees.Tree of T nodes, for every request), with an out and lse of its own: the
        reference's inputs for a peer whose mask is another tree's (FlashMLA's causal MTP mask is a chain's)."""
        import copy
        from dataclasses import replace

        cp = cupy_module()
        pr = self.problem
        if tree.T != pr.T:
            raise ValueError(f"the tree has {tree.T} nodes; this problem's trees have {pr.T}")
        every = lambda a: np.ascontiguousarray(np.broadcast_to(a, (pr.B, *a.shape)))  # noqa: E731
        new = copy.copy(self)  # the same device buffers; the mask, out and lse replaced below
        new.problem = replace(pr, tree_parent=every(tree.parent), tree_depth=every(tree.depth),
                              tree_mask=every(tree.mask_words()))
        new.tree_mask = cp.asarray(new.problem.tree_mask)
        new.out, new.lse = cp.empty_like(self.out), cp.empty_like(self.lse)
        return new

    def upload(self, problem) -> None:
        """Write ``problem``'s inputs (q, cache, block table, prefix lengths, tree mask) into these buffers in
        place, as a server writes a step's inputs into the buffers a CUDA graph was captured on. ValueError,
        naming the first, where a buffer's shape or dtype differs; the output buffers stay as they are."""
        problem.validate()
        host = {"q": storage_bits(problem.q), "kv_cache": storage_bits(problem.kv_cache),
                "block_table": np.ascontiguousarray(problem.block_table, np.int32),
                "prefix_lens": np.ascontiguousarray(problem.prefix_lens, np.int32),
                "tree_mask": np.ascontiguousarray(problem.tree_mask, np.uint32)}
        check_upload({name: getattr(self, name) for name in INPUTS}, host)
        for name, a in host.items():
            getattr(self, name).set(a)
        self.problem = problem

    def poison(self) -> None:
        """A signalling-NaN pattern everywhere, so an element never written is caught (UNWRITTEN).

        Arithmetic never produces these bit patterns, so compare can tell "never written" from
        "computed NaN".
        """
        if self.out_dtype == "fp32":
            self.out.view(np.uint32).fill(POISON_F32_BITS)
        else:
            self.out.fill(POISON_BF16_BITS)
        self.lse.view(np.uint32).fill(POISON_F32_BITS)

    def randomize(self, seed: int) -> None:
        """Fresh random q and owned cache rows drawn on the GPU (bench inputs; never zeros).

        Unowned slots keep whatever the host layout had (NaN). The host Problem's q/kv_cache
        become stale: ``download_inputs`` brings the drawn values back when a reference needs them.
        """
        cp = cupy_module()
        rs = cp.random.RandomState(seed)
        pr = self.problem
        self.q[...] = self._storage(rs.standard_normal(self.q.shape, dtype=cp.float32))
        flat = self.kv_cache.reshape(-1, pr.kv_cache.shape[-1])
        for b in range(pr.B):
            slots = cp.asarray(pr.tokens(b))
            flat[slots] = self._storage(rs.standard_normal((int(slots.size), flat.shape[1]), dtype=cp.float32))

    def _storage(self, x32):
        """fp32 device values -> this problem's storage bits (bf16 by round-to-nearest-even)."""
        cp = cupy_module()
        if self.kv_cache.dtype == cp.float32:
            return x32
        u = x32.view(cp.uint32)
        return ((u + cp.uint32(0x7FFF) + ((u >> 16) & cp.uint32(1))) >> 16).astype(cp.uint16)

    def download_inputs(self):
        """The host Problem with the device's current q and cache values."""
        from dataclasses import replace

        pr = self.problem
        return replace(pr, q=self.q.get().view(pr.q.dtype), kv_cache=self.kv_cache.get().view(pr.kv_cache.dtype))

    def params(self, workspace_ptr: int = 0, num_splits: int = 1, prefix_lens_ptr: int | None = None) -> np.void:
        """The launch's KdtrParams; ``prefix_lens_ptr``: where the kernel reads the prefix lengths (default
        this problem's buffer; the planted baked-lengths bug points it at a copy of its own)."""
        pr = self.problem
        return abi.pack_params(
            q=self.q.data.ptr, kv_cache=self.kv_cache.data.ptr, block_table=self.block_table.data.ptr,
            prefix_lens=self.prefix_lens.data.ptr if prefix_lens_ptr is None else prefix_lens_ptr, tree_mask=self.tree_mask.data.ptr, out=self.out.data.ptr,
            lse=self.lse.data.ptr, workspace=workspace_ptr, B=pr.B, T=pr.T, H=pr.H, page_size=pr.page_size,
            max_pages=pr.block_table.shape[1], mask_words=pr.tree_mask.shape[2], num_pages=pr.kv_cache.shape[0],
            num_splits=num_splits, scale=pr.scale,
        )

    def download(self) -> tuple[np.ndarray, np.ndarray]:
        out = self.out.get()
        return (out if self.out_dtype == "fp32" else bf16_bits_to_f32(out)), self.lse.get()


@dataclass
class Loaded:
    function: object
    module: object
    compiled: nvrtc.Compiled
    consts: tuple[int, int, int, int]
    """kdtr_launch of the module, or DEFAULT_LAUNCH."""
    dependent: bool = False
    """The kernel opens with kdtr::pdl_wait(): as a later step it is launched dependent (kdtr/kernels/pdl.py)."""


_MODULES: dict[str, object] = {}


def _module(compiled: nvrtc.Compiled):
    """The loaded module of a compiled build, loaded once a process (from the cubin cache, or from a private
    copy where the cache is not writable)."""
    if compiled.key not in _MODULES:
        path = compiled.path
        if path is None:  # cache not writable: a private copy
            import tempfile

            fd, tmp = tempfile.mkstemp(suffix=".cubin")
            with open(fd, "wb") as f:
                f.write(compiled.cubin)
            path = Path(tmp)
        _MODULES[compiled.key] = cupy_module().RawModule(path=str(path))
    return _MODULES[compiled.key]


def load_function(source_path, name_expression: str, arch: str | None = None, options=(), dependent: bool = False) -> Loaded:
    """Compile (or take from the cubin cache) one kernel for this device and load it."""
    compiled = nvrtc.compile_file(source_path, [name_expression], arch or device_arch(), options=tuple(options))
    module = _module(compiled)
    try:
        consts = read_global_ints(module, "kdtr_launch", 4)
    except Exception:  # no kdtr_launch in this file (CUDA_ERROR_NOT_FOUND)
        consts = DEFAULT_LAUNCH
    return Loaded(module.get_function(compiled.lowered[name_expression]), module, compiled, consts, dependent)


def load_source(source_text: str, name_expression: str, name: str, arch: str | None = None) -> Loaded:
    """load_function for a kernel whose source kdtr holds as text (a helper kernel, e.g. kdtr/kernels/serving.py's
    block-table gather): compiled through kdtr's NVRTC and its cubin cache, loaded once per build."""
    compiled = nvrtc.compile_cuda(source_text, [name_expression], arch or device_arch(), name=name)
    module = _module(compiled)
    return Loaded(module.get_function(compiled.lowered[name_expression]), module, compiled, DEFAULT_LAUNCH)


def external_stream(ptr: int):
    """A cupy stream object for a CUDA stream kdtr does not own (a server's, e.g. torch's current stream's
    ``cuda_stream``): launches given it enqueue there. One object per address."""
    if ptr not in _STREAMS:
        _STREAMS[ptr] = cupy_module().cuda.ExternalStream(ptr)
    return _STREAMS[ptr]


_STREAMS: dict[int, object] = {}


def read_global_ints(module, name: str, n: int) -> tuple[int, ...]:
    """The first n ints of an ``extern "C"`` __device__ / __constant__ array of a loaded module."""
    cp = cupy_module()
    return tuple(int(x) for x in cp.ndarray((n,), cp.int32, module.get_global(name)).get())


def device_ints(a: np.ndarray):
    """An int32 table on the GPU, passed to a kernel as a pointer argument (e.g. flash-sm90's work table);
    the launcher's argument tuple keeps it alive. An empty table is a null pointer."""
    if a.size == 0:
        return np.uint64(0)
    return cupy_module().asarray(np.ascontiguousarray(a, np.int32))


def synchronize(cp, what: str) -> None:
    try:
        cp.cuda.runtime.deviceSynchronize()
    except Exception as e:
        raise KernelRuntimeError(f"{what}: {e}") from e


def make_launcher(dp: DeviceProblem, steps: list[Step], workspace_bytes: int = 0, num_splits: int = 1, *,
                  workspace=None, baked_lengths: bool = False):
    """A zero-argument callable that enqueues ``steps`` in order, each with one KdtrParams (then the step's
    own arguments, e.g. flash-sm90's tensor map) and one zero-filled workspace; no poison, no sync (what
    bench times). Everything is decided here: the call packs nothing, allocates nothing and reads no
    device value, so it can be captured into a CUDA graph (capture) and replayed on new inputs.

    workspace: a zero-filled device buffer of at least ``workspace_bytes`` to use (one workspace serves
    every layer of a server); None allocates one. baked_lengths: the planted baked-lengths bug
    (kdtr/kernels/bugs.py): the kernels read a copy of dp's prefix lengths made here."""
    cp = cupy_module()
    if workspace is not None and workspace.nbytes < workspace_bytes:
        raise ValueError(f"workspace of {workspace.nbytes} bytes; this launch needs {workspace_bytes}")
    ws = workspace if workspace is not None else cp.zeros(workspace_bytes, cp.uint8) if workspace_bytes else None
    baked = cp.asarray(np.ascontiguousarray(dp.problem.prefix_lens, np.int32)) if baked_lengths else None
    arg = abi.as_kernel_arg(dp.params(ws.data.ptr if ws is not None else 0, num_splits,
                                      None if baked is None else baked.data.ptr))
    allow_smem(steps)
    calls = step_calls(steps, arg)

    def go():
        stream = cp.cuda.get_current_stream().ptr
        for call in calls:
            call(stream)

    go.workspace = ws  # keeps the scratch alive as long as the launcher
    go.problem = dp  # and the inputs and outputs: the launches hold only their addresses
    go.keep = (baked, *(k for s in steps for k in s.keep))  # and the tables the arguments point into
    return go


class CudaGraph:
    """A CUDA graph captured from a launcher (on a stream of its own); ``replay`` launches it on the current
    stream, as a server replays its graphs on its own stream."""

    def __init__(self, graph, stream, keep=None):
        self.graph, self.stream = graph, stream
        self.keep = keep
        """What was captured (the launcher): the graph holds only the addresses of its workspace, tables and
        buffers, so they must live as long as it does (freed, the pool hands them out again)."""

    def replay(self) -> None:
        self.graph.launch(cupy_module().cuda.get_current_stream())


def capture(fn) -> CudaGraph:
    """Capture what ``fn()`` enqueues on the current stream into a CUDA graph, on a fresh non-blocking
    stream (cupy's default capture mode, relaxed). CaptureError, with CUDA's words, where ``fn`` does
    anything capture refuses: synchronises, copies to or from the host, reads a device value (an allocation
    the relaxed mode lets through; kdtr's own launchers allocate nothing once prepared)."""
    cp = cupy_module()
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        try:
            fn()
        except Exception as e:
            _end_capture_quietly(stream)
            raise CaptureError(f"the launch cannot be captured: {type(e).__name__}: {' '.join(str(e).split())}") from e
        try:
            graph = stream.end_capture()
        except Exception as e:
            raise CaptureError(f"the capture was invalidated: {type(e).__name__}: {' '.join(str(e).split())}") from e
    return CudaGraph(graph, stream, fn)


def _end_capture_quietly(stream) -> None:
    """Leave capture mode after a failed capture (the partial graph is dropped)."""
    try:
        stream.end_capture()
    except Exception:
        pass


class GraphRun:
    """A kernel prepared on one set of device buffers and captured once, as a server captures its verify
    launch: ``load`` writes a problem's inputs into the same buffers, ``replay`` runs the graph on them."""

    def __init__(self, name: str, dp: DeviceProblem, launcher):
        self.name, self.dp = name, dp
        self.launcher = launcher  # keeps the launch's tables and workspace alive with the graph
        self.graph = capture(launcher)

    def load(self, problem) -> None:
        self.dp.upload(problem)

    def replay(self) -> RunOutput:
        """Poison the outputs, replay, wait, download; ms is the replay's device time."""
        cp = cupy_module()
        self.dp.poison()
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        try:
            start.record()
            self.graph.replay()
            stop.record()
        except Exception as e:
            raise KernelRuntimeError(f"{self.name}: graph replay failed: {e}") from e
        synchronize(cp, self.name)
        out, lse = self.dp.download()
        return RunOutput(out, lse, float(cp.cuda.get_elapsed_time(start, stop)))


def capture_kernel(kernel, problem, out_dtype: str) -> GraphRun:
    """``kernel`` (with a ``prepare(dp)`` launcher) prepared on device buffers holding ``problem`` and
    captured: everything the launch decides is decided here, on ``problem``'s lengths."""
    dp = DeviceProblem(problem, out_dtype)
    return GraphRun(kernel.name, dp, kernel.prepare(dp))


def pdl_enabled() -> bool:
    """Dependent launches (kdtr/kernels/pdl.py) where the device has them (sm_90+)."""
    return int(device_info()["cc"][3:]) >= 90


def allow_smem(steps) -> None:
    """Let each step's kernel take the dynamic shared memory it launches with (past the 48 KB default). The limit
    only rises: builds loaded once a process are shared by kernels that launch them with different requests
    (``flash`` and ``flash[occupancy=sm_120]``'s padded one), and a launcher prepared for the larger must still run."""
    for s in steps:
        fn = s.loaded.function
        if s.smem > _STATIC_SMEM_LIMIT and s.smem > fn.max_dynamic_shared_size_bytes:
            fn.max_dynamic_shared_size_bytes = s.smem


def step_calls(steps, params, step_args=lambda s: s.args, external: bool = False) -> list:
    """One callable(stream_ptr) per step, its arguments packed now: KdtrParams ``params``, then the step's own
    (``step_args(step)``). A later step that opens with pdl_wait is launched dependent on the one before where the
    device allows it (kdtr/kernels/pdl.py); the others are plain launches on cupy's current stream or, with
    ``external``, on the stream at stream_ptr (one kdtr does not own: a server's)."""
    calls = []
    for i, s in enumerate(steps):
        step = (s.loaded, tuple(s.grid), tuple(s.block), s.smem, (params, *step_args(s)))
        if i and s.loaded.dependent and pdl_enabled():
            calls.append(_dependent_call(*step))
        else:
            calls.append(_external_call(*step) if external else _plain_call(*step))
    return calls


def _plain_call(loaded, grid, block, smem, args):
    return lambda stream: loaded.function(grid, block, args, shared_mem=smem)


def _external_call(loaded, grid, block, smem, args):
    def go(stream_ptr: int) -> None:
        with external_stream(stream_ptr):  # cupy launches on its current stream
            loaded.function(grid, block, args, shared_mem=smem)
    return go


def _dependent_call(loaded, grid, block, smem, args):
    from kdtr.kernels import pdl

    return pdl.prepare(function_ptr(loaded.function), grid, block, smem, args)


def function_ptr(fn) -> int:
    """The CUfunction of a loaded kernel (a cupy RawKernel holds it as .kernel, a cupy Function is it)."""
    return int(getattr(fn, "kernel", fn).ptr)


def launch_kernels(name: str, dp: DeviceProblem, steps, workspace_bytes: int = 0, num_splits: int = 1, *,
                   baked_lengths: bool = False) -> RunOutput:
    """Poison dp's outputs, run ``steps`` in order, synchronize, download. ms spans all the steps."""
    cp = cupy_module()
    go = make_launcher(dp, steps, workspace_bytes, num_splits, baked_lengths=baked_lengths)
    dp.poison()
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    try:
        start.record()
        go()
        stop.record()
    except Exception as e:
        raise KernelRuntimeError(f"{name}: launch failed: {e}") from e
    synchronize(cp, name)
    out, lse = dp.download()
    return RunOutput(out, lse, float(cp.cuda.get_elapsed_time(start, stop)))


class CudaKernel:
    """A CUDA kernel taking ``const KdtrParams``: compiled per (kv dtype, out dtype) on first use."""

    writes_lse = True

    def __init__(self, name: str, source, template: str, geometry=None, bug: int = 0, caps=None, options=()):
        self.name, self.source, self.template = name, Path(source), template
        self.geometry = geometry
        """problem -> Launch; None: the file's kdtr_launch constants (the user-kernel contract)."""
        self.bug, self.caps, self.options = int(bug), caps, tuple(options)
        self._loaded: dict[tuple[str, str], Loaded] = {}

    @property
    def baked_lengths(self) -> bool:
        """The planted baked-lengths bug: a launch bug, run on the correct build."""
        return self.bug == Bug.BAKED_LENGTHS

    def name_expression(self, kv_dtype: str, out_dtype: str) -> str:
        t = self.template.replace("{kv}", CTYPES[kv_dtype]).replace("{out}", CTYPES[out_dtype])
        return t.replace("{bug}", str(kernel_bug(Bug(self.bug))))

    def load(self, kv_dtype: str, out_dtype: str) -> Loaded:
        key = (kv_dtype, out_dtype)
        if key not in self._loaded:
            self._loaded[key] = load_function(self.source, self.name_expression(kv_dtype, out_dtype), options=self.options)
        return self._loaded[key]

    def run(self, problem, out_dtype: str) -> RunOutput:
        return self.run_on(DeviceProblem(problem, out_dtype))

    def steps(self, dp: DeviceProblem) -> tuple[list[Step], int, int]:
        """([Step], workspace_bytes, num_splits) for dp's shape."""
        loaded = self.load(dp.problem.kv_dtype, dp.out_dtype)
        g = self.geometry(dp.problem) if self.geometry else launch_from_constants(dp.problem, loaded.consts)
        return [Step(loaded, g.grid, g.block, g.smem_bytes)], g.workspace_bytes, g.num_splits

    def run_on(self, dp: DeviceProblem) -> RunOutput:
        """Poison, launch once, synchronize, download (inputs already on the GPU)."""
        return launch_kernels(self.name, dp, *self.steps(dp), baked_lengths=self.baked_lengths)

    def prepare(self, dp: DeviceProblem, workspace=None):
        """A no-sync launcher on dp (for timing and graph capture); ``workspace``: see make_launcher."""
        return make_launcher(dp, *self.steps(dp), workspace=workspace, baked_lengths=self.baked_lengths)

    def graph(self, problem, out_dtype: str) -> GraphRun:
        """Prepared on buffers holding ``problem`` and captured into a CUDA graph (kdtr verify --graph)."""
        return capture_kernel(self, problem, out_dtype)


__all__ = [
    "CTYPES", "CaptureError", "CudaGraph", "CudaKernel", "GraphRun", "capture", "capture_kernel", "DeviceProblem", "GpuUnavailable", "KernelRuntimeError", "Launch", "Loaded",
    "RunOutput", "Step", "device_arch", "device_info", "gpu_available", "gpu_unavailable_reason",
    "allow_smem", "device_ints", "external_stream", "launch_from_constants", "launch_kernels", "make_launcher",
    "load_function", "load_source", "read_global_ints", "step_calls",
]
