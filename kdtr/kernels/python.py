"""Python callables as kernels: ``package.module:fn`` (importable) or ``path/to/file.py:fn`` (loaded
from that file, whose folder goes on sys.path, so isolated child processes find it too).

The contract (README, "Write and verify your own kernel")::

    fn(q, kv_cache, block_table, prefix_lens, tree_mask, *, scale, page_size, out_dtype) -> (out, lse)

on cupy arrays (bf16 as raw uint16 bits, the mask uint32), torch tensors with
``fn.kdtr_framework = "torch"`` (bf16 as torch.bfloat16, the mask int32), or numpy arrays and no
GPU with ``fn.kdtr_device = "cpu"`` (bf16 as ml_dtypes.bfloat16, the mask uint32). out is
[B, T, H, 512] in out_dtype ("fp32" or "bf16"), lse [B, T, H] fp32 natural log. A callable that
does not compute lse sets ``fn.kdtr_writes_lse = False`` and returns out alone (lse is then not
checked); ``fn.kdtr_caps`` (a kdtr.kernels.caps.Caps) limits what it takes, other bundles SKIP.

A callable written for SGLang's target-verify layout sets ``fn.kdtr_layout = "sglang"`` (flat bool
mask) or ``"sglang-bitpacked"`` (one mask word per query row; bundles with T > 32 SKIP) and gets
kdtr.adapters.sglang's tensors instead, on the same device and framework as above::

    fn(q, k_buffer, v_buffer, kv_indptr, kv_indices, k_extend, v_extend, qo_indptr, custom_mask,
       mask_indptr, *, scale, out_dtype) -> (out, lse)

with SGLang's extend_attention meaning: q [B*T, H, 576]; k_buffer [slots, 1, 576] the page-size-1
token pool, v_buffer its first 512 columns; kv_indptr [B+1] int32 / kv_indices int64 the prefix
slots; k_extend [B*T, 1, 576] / v_extend the tree nodes' latents (also in the pool); qo_indptr
[B+1] int32; custom_mask and mask_indptr as SglangBatch documents them (torch: a bit-packed mask as
int32). out is [B*T, H, 512], lse [B*T, H]; kdtr reshapes them to [B, T, H, ...].

Timing (``kdtr bench -k module:fn``): ``prepare`` converts the bench's device problem into the callable's
inputs once (cupy arrays, torch tensors sharing them, or SGLang's tensors through kdtr.adapters.sglang),
outside the timed region, and returns a launcher that only calls ``fn``: so a callable is timed like a
built-in kernel, by CUDA events around its launches (whatever it allocates per call is its own cost). A CPU
callable is not timed (SKIPPED with the reason).

CUDA graphs (``kdtr verify --graph``): a GPU callable is called once on device buffers holding the
capture problem, then captured calling them again (cupy: kdtr.kernels.launch.capture; torch:
torch.cuda.graph after a side-stream warm-up); the arrays it returns there are the graph's outputs, and
every replay reads the buffers as the next problem left them. So the callable must not synchronise, copy
to the host or decide anything from the lengths on the host (a capture that refuses is CAPTURE_ERROR;
a decision frozen at the capture's lengths fails the replay). A CPU callable has no launch to freeze:
it is called at each replay on the same host arrays, rewritten in place (a callable that caches results
per array fails). The SGLang layouts are not captured (their tensors are sized by the lengths): SKIPPED.
"""

from __future__ import annotations

import importlib
import re
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from kdtr.adapters.sglang import MAX_BITPACKED_T, to_sglang
from kdtr.errors import KernelSpecError
from kdtr.kernels.caps import Caps
from kdtr.kernels.contract import POISON_BF16_BITS, POISON_F32_BITS
from kdtr.kernels.emulate import HostBuffers, HostGraphRun, MockGraph
from kdtr.kernels.launch import DeviceProblem, capture, cupy_module, synchronize
from kdtr.kernels.launch_types import INPUTS, CaptureError, KernelRuntimeError, RunOutput, storage_bits, to_f32

PY_SPEC = re.compile(r"(?:(?P<file>[^:]+\.py)|(?P<module>[A-Za-z_][\w.]*)):(?P<attr>[A-Za-z_][\w.]*)")
"""A kernel spec naming a Python callable: ``package.module:fn`` or ``path/to/file.py:fn``."""
DEVICES = ("cuda", "cpu")
"""Values of ``fn.kdtr_device`` (default "cuda")."""
FRAMEWORKS = ("cupy", "torch")
"""Values of ``fn.kdtr_framework`` (default "cupy"; used with kdtr_device "cuda")."""
LAYOUTS = ("kdtr", "sglang", "sglang-bitpacked")
"""Values of ``fn.kdtr_layout`` (default "kdtr"): which tensors the callable is handed."""
SGLANG_ARGS = ("q", "k_buffer", "v_buffer", "kv_indptr", "kv_indices", "k_extend", "v_extend", "qo_indptr",
               "custom_mask", "mask_indptr")
"""The positional arguments of an SGLang-layout callable: kdtr.adapters.sglang.SglangBatch fields."""


class NoGraph(Exception):
    """verify --graph cannot capture this kernel for a reason that is no fault of the kernel (a layout that
    fixed buffers cannot hold): its cases are SKIPPED with the message."""


class PyCallableKernel:
    """A Python callable following the module docstring's contract."""

    def __init__(self, fn, name: str, caps: Caps | None = None):
        self.fn, self.name = fn, name
        self.framework = getattr(fn, "kdtr_framework", "cupy")
        self.device = getattr(fn, "kdtr_device", "cuda")
        self.layout = getattr(fn, "kdtr_layout", "kdtr")
        caps = replace(getattr(fn, "kdtr_caps", None) or caps or Caps(), needs_gpu=self.device == "cuda")
        if self.layout == "sglang-bitpacked":
            caps = replace(caps, max_T=min(caps.max_T or MAX_BITPACKED_T, MAX_BITPACKED_T))
        self.caps = caps
        self.writes_lse = bool(getattr(fn, "kdtr_writes_lse", True))

    @staticmethod
    def missing_output_fix(output: str) -> str:
        """What a SHAPE failure of an output the callable did not return says to do (kdtr.check.case)."""
        return (f"the callable returned out alone: return (out, lse), or set kdtr_writes_lse = False on it "
                f"if it does not compute {output}")

    def _host_args(self, problem) -> list[np.ndarray]:
        """The callable's positional arguments as numpy arrays, in its layout."""
        if self.layout == "kdtr":
            return [np.ascontiguousarray(a) for a in (problem.q, problem.kv_cache)] + [
                np.ascontiguousarray(a, t) for a, t in ((problem.block_table, np.int32), (problem.prefix_lens, np.int32),
                                                        (problem.tree_mask, np.uint32))]
        batch = to_sglang(problem, bitpacked=self.layout == "sglang-bitpacked")
        return [getattr(batch, name) for name in SGLANG_ARGS]

    def _kwargs(self, problem, out_dtype: str) -> dict:
        """The keyword arguments of every call (the module docstring's contract): page_size in kdtr's layout."""
        kw = {"scale": float(problem.scale), "out_dtype": out_dtype}
        if self.layout == "kdtr":
            kw["page_size"] = problem.page_size
        return kw

    def _call(self, args, problem, out_dtype: str):
        try:
            res = self.fn(*args, **self._kwargs(problem, out_dtype))
            if self.device == "cuda" and self.framework == "torch":
                import torch

                torch.cuda.synchronize()
            return res
        except Exception as e:
            raise KernelRuntimeError(f"{self.name}: {type(e).__name__}: {e}") from e

    def _outputs(self, res, problem) -> tuple[np.ndarray, np.ndarray | None]:
        """(out, lse or None) as float32 numpy in kdtr's shapes, from what fn returned."""
        out, lse = res, None
        if isinstance(res, (tuple, list)):
            if len(res) != 2:
                raise KernelRuntimeError(f"{self.name}: returned {len(res)} values; return (out, lse)")
            out, lse = res[0], (res[1] if self.writes_lse else None)
        out, lse = to_f32(out), None if lse is None else to_f32(lse)
        if self.layout == "kdtr":
            return out, lse
        B, T, H = problem.B, problem.T, problem.H
        for what, a, shape, dims in (("out", out, (B * T, H, 512), "[B*T, H, 512]"), ("lse", lse, (B * T, H), "[B*T, H]")):
            if a is not None and a.shape != shape:
                raise KernelRuntimeError(f"{self.name}: the SGLang layout returns {what} {dims} = {list(shape)}, "
                                         f"got {list(a.shape)}")
        return out.reshape(B, T, H, 512), None if lse is None else lse.reshape(B, T, H)

    def _run_cpu(self, problem, out_dtype: str) -> RunOutput:
        problem.validate()
        args = self._host_args(problem)
        t0 = time.perf_counter()
        res = self._call(args, problem, out_dtype)
        ms = (time.perf_counter() - t0) * 1e3
        return RunOutput(*self._outputs(res, problem), ms)

    def _device_args(self, cp, problem, out_dtype: str) -> list:
        """The callable's positional arguments as cupy arrays (bf16 as uint16 bits), in its layout."""
        if self.layout == "kdtr":
            dp = DeviceProblem(problem, out_dtype)
            return [dp.q, dp.kv_cache, dp.block_table, dp.prefix_lens, dp.tree_mask]
        host = dict(zip(SGLANG_ARGS, self._host_args(problem)))
        dev = {k: cp.asarray(storage_bits(a)) for k, a in host.items() if k not in ("v_buffer", "v_extend")}
        dev["v_buffer"], dev["v_extend"] = dev["k_buffer"][..., :512], dev["k_extend"][..., :512]  # views, as SGLang's
        return [dev[k] for k in SGLANG_ARGS]

    def _framework_args(self, cp, args: list, problem) -> list:
        """cupy arguments as the callable's framework takes them: torch tensors sharing their memory (bf16 as
        torch.bfloat16, uint32 as int32), so a write into the cupy buffers is what the callable reads."""
        if self.framework != "torch":
            return args
        import torch

        bf16 = problem.kv_dtype == "bf16"
        return [
            torch.from_dlpack(a.view(cp.int16)).view(torch.bfloat16) if (a.dtype == cp.uint16 and bf16)
            else torch.from_dlpack(a.view(cp.int32) if a.dtype == cp.uint32 else a)
            for a in args
        ]

    def run(self, problem, out_dtype: str) -> RunOutput:
        if self.device == "cpu":
            return self._run_cpu(problem, out_dtype)
        cp = cupy_module()
        args = self._framework_args(cp, self._device_args(cp, problem, out_dtype), problem)
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        res = self._call(args, problem, out_dtype)
        stop.record()
        synchronize(cp, self.name)
        return RunOutput(*self._outputs(res, problem), float(cp.cuda.get_elapsed_time(start, stop)))

    @property
    def untimed(self) -> str | None:
        """Why ``kdtr bench`` cannot time this callable (a skip reason), or None: a CPU callable has no device time."""
        if self.device == "cpu":
            return "a CPU callable (kdtr_device 'cpu') has no device time to measure; bench times GPU callables"
        return None

    def prepare(self, dp, workspace=None):
        """A zero-argument launcher that only calls the callable, as ``kdtr bench`` times the built-in kernels
        (the module docstring, "Timing"): its inputs are made here, once, from ``dp`` (a DeviceProblem's buffers
        on a GPU, a kdtr.kernels.emulate.HostBuffers' arrays for a CPU callable), outside the timed region.
        ``workspace`` is ignored (a callable owns its scratch)."""
        out_dtype, problem = dp.out_dtype, dp.problem
        if self.layout != "kdtr" and hasattr(dp, "download_inputs"):  # SGLang's tensors are made of the values dp holds
            problem = dp.download_inputs()
        if self.device == "cpu":
            args = [getattr(dp, name) for name in INPUTS] if self.layout == "kdtr" else self._host_args(problem)
        else:
            cp = cupy_module()
            raw = ([getattr(dp, name) for name in INPUTS] if self.layout == "kdtr"
                   else self._device_args(cp, problem, out_dtype))
            args = self._framework_args(cp, raw, problem)
        kw = self._kwargs(problem, out_dtype)
        fn = self.fn

        def go():
            return fn(*args, **kw)

        go.args = args  # the converted inputs live as long as the launcher
        return go

    def graph(self, problem, out_dtype: str):
        """The callable prepared and captured on buffers holding ``problem`` (kdtr verify --graph; module
        docstring, "CUDA graphs"). NoGraph for the SGLang layouts, CaptureError where capture refuses the call."""
        if self.layout != "kdtr":
            raise NoGraph(f"kdtr_layout {self.layout!r}: the SGLang tensors (kv_indices, custom_mask) are sized by "
                          "the prefix lengths, so no fixed buffers hold another step's; verify --graph takes the "
                          "kdtr layout")
        if self.device == "cpu":
            return self._graph_cpu(problem, out_dtype)
        return CallableGraphRun(self, problem, out_dtype)

    def _graph_cpu(self, problem, out_dtype: str) -> HostGraphRun:
        """A CPU callable has no launch to freeze: it is called once on host buffers holding ``problem`` (the
        warm-up a GPU callable gets), then its mock graph calls it at every replay on the same arrays, rewritten
        in place, with the capture's scale and page size (a launch's by-value arguments). What it keeps from
        the warm-up (a plan per array) is what a graph would keep."""
        buffers = HostBuffers(problem, out_dtype)
        args = [getattr(buffers, name) for name in INPUTS]
        self._call(args, problem, out_dtype)

        def launch():
            return self._outputs(self._call(args, problem, out_dtype), problem)

        return HostGraphRun(self.name, buffers, MockGraph(launch))


class CallableGraphRun:
    """A GPU callable captured as a server captures its verify call: called once outside capture on device
    buffers holding the capture problem (module loads, allocator pools), then captured calling the same
    buffers, whose returned out and lse arrays become the graph's static outputs. ``load`` writes another
    problem's inputs into the argument buffers in place; ``replay`` poisons the static outputs, replays,
    waits and converts them as a plain run does."""

    def __init__(self, kernel: PyCallableKernel, problem, out_dtype: str):
        cp = cupy_module()
        self.kernel, self.problem, self.name = kernel, problem, kernel.name
        self.dp = DeviceProblem(problem, out_dtype)
        args = kernel._framework_args(cp, [getattr(self.dp, name) for name in INPUTS], problem)
        kw = kernel._kwargs(problem, out_dtype)  # kdtr's layout: the SGLang ones are not captured (NoGraph)
        if kernel.framework == "torch":
            self._capture_torch(args, kw)
        else:
            self._capture_cupy(cp, args, kw)

    def _capture_cupy(self, cp, args, kw) -> None:
        self.kernel._call(args, self.problem, kw["out_dtype"])  # the warm-up, outside capture
        synchronize(cp, self.name)
        held = []
        self.graph = capture(lambda: held.append(self.kernel.fn(*args, **kw)))  # CaptureError where refused
        self.static = held[0]
        self.torch_graph = None

    def _capture_torch(self, args, kw) -> None:
        """torch.cuda.graph, after a warm-up call on a side stream, as torch's documentation does it."""
        import torch

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        try:
            with torch.cuda.stream(side):
                self.kernel.fn(*args, **kw)
        except Exception as e:
            raise KernelRuntimeError(f"{self.name}: {type(e).__name__}: {e}") from e
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                self.static = self.kernel.fn(*args, **kw)
        except Exception as e:
            raise CaptureError(f"the call cannot be captured: {type(e).__name__}: {' '.join(str(e).split())}") from e
        self.torch_graph, self.graph = graph, None

    def load(self, problem) -> None:
        self.dp.upload(problem)

    def _poison(self) -> None:
        """Poison patterns in the static outputs (an element the replay leaves alone reads UNWRITTEN)."""
        outs = self.static if isinstance(self.static, (tuple, list)) else (self.static,)
        for a in outs:
            if hasattr(a, "detach"):  # torch
                import torch

                wide = a.element_size() == 4
                a.view(torch.int32 if wide else torch.int16).fill_(POISON_F32_BITS if wide else POISON_BF16_BITS)
            elif hasattr(a, "view") and hasattr(a, "fill") and a.dtype.itemsize in (2, 4):
                wide = a.dtype.itemsize == 4
                a.view(np.uint32 if wide else np.uint16).fill(POISON_F32_BITS if wide else POISON_BF16_BITS)

    def replay(self) -> RunOutput:
        cp = cupy_module()
        self._poison()
        cp.cuda.Device().synchronize()  # the uploads and the poison land before the graph's stream reads them
        try:
            if self.torch_graph is not None:
                import torch

                start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                self.torch_graph.replay()
                stop.record()
                torch.cuda.synchronize()
                ms = float(start.elapsed_time(stop))
            else:
                start, stop = cp.cuda.Event(), cp.cuda.Event()
                start.record()
                self.graph.replay()  # on the current stream (kdtr.kernels.launch.CudaGraph)
                stop.record()
                synchronize(cp, self.name)
                ms = float(cp.cuda.get_elapsed_time(start, stop))
        except KernelRuntimeError:
            raise
        except Exception as e:
            raise KernelRuntimeError(f"{self.name}: graph replay failed: {type(e).__name__}: {e}") from e
        return RunOutput(*self.kernel._outputs(self.static, self.problem), ms)


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def _import_file(spec: str, file: str):
    """The module of ``file``, imported under its stem with its folder first on sys.path."""
    path = Path(file)
    if not path.is_file():
        raise KernelSpecError(f"{spec}: no such Python file {file!r}")
    path = path.resolve()
    if not path.stem.isidentifier():
        raise KernelSpecError(f"{spec}: {path.name!r} is not an importable module name; rename it, e.g. my_kernel.py")
    folder = str(path.parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)  # the run's own imports, and PYTHONPATH of isolated children
    try:
        module = importlib.import_module(path.stem)
    except Exception as e:  # anything the file raises while importing
        raise KernelSpecError(f"{spec}: cannot import {file!r}: {_one_line(e)}") from None
    found = getattr(module, "__file__", None)
    if not found or Path(found).resolve() != path:
        raise KernelSpecError(f"{spec}: the module name {path.stem!r} is already taken by "
                              f"{found or 'a built-in module'}; rename {path.name}")
    return module


def _import_module(spec: str, name: str):
    try:
        return importlib.import_module(name)
    except Exception as e:  # ImportError, or anything the module raises while importing
        hint = ""
        if isinstance(e, ModuleNotFoundError) and e.name and name.startswith(e.name):
            hint = (f" (put its folder on PYTHONPATH, or name the file: -k path/to/{name.split('.')[-1]}.py:"
                    f"{spec.rpartition(':')[2]})")
        raise KernelSpecError(f"{spec}: cannot import module {name!r}: {_one_line(e)}{hint}") from None


def python_kernel(spec: str) -> PyCallableKernel:
    """The PyCallableKernel that ``module:fn`` or ``file.py:fn`` names; KernelSpecError (one line)
    when it names none or its kdtr_* attributes are wrong."""
    m = PY_SPEC.fullmatch(spec)
    obj = _import_file(spec, m["file"]) if m["file"] else _import_module(spec, m["module"])
    where, attr = m["file"] or m["module"], m["attr"]
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise KernelSpecError(f"{spec}: {where!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise KernelSpecError(f"{spec}: {attr!r} is a {type(obj).__name__}, not a callable")
    device, framework = getattr(obj, "kdtr_device", "cuda"), getattr(obj, "kdtr_framework", "cupy")
    if device not in DEVICES:
        raise KernelSpecError(f"{spec}: kdtr_device must be one of {', '.join(map(repr, DEVICES))}, got {device!r}")
    if framework not in FRAMEWORKS:
        raise KernelSpecError(f"{spec}: kdtr_framework must be one of {', '.join(map(repr, FRAMEWORKS))}, "
                              f"got {framework!r}")
    if device == "cpu" and framework != "cupy":
        raise KernelSpecError(f"{spec}: kdtr_device 'cpu' hands the callable numpy arrays; kdtr_framework "
                              f"{framework!r} needs kdtr_device 'cuda'")
    layout = getattr(obj, "kdtr_layout", "kdtr")
    if layout not in LAYOUTS:
        raise KernelSpecError(f"{spec}: kdtr_layout must be one of {', '.join(map(repr, LAYOUTS))}, got {layout!r}")
    if not isinstance(getattr(obj, "kdtr_writes_lse", True), bool):
        raise KernelSpecError(f"{spec}: kdtr_writes_lse must be True or False, got {obj.kdtr_writes_lse!r}")
    caps = getattr(obj, "kdtr_caps", None)
    if caps is not None and not isinstance(caps, Caps):
        raise KernelSpecError(f"{spec}: kdtr_caps must be a kdtr.kernels.caps.Caps, got {type(caps).__name__}")
    return PyCallableKernel(obj, spec)
