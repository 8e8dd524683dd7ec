"""Python callables as kernels: ``package.module:callable`` on cupy arrays, torch tensors, or numpy
arrays on the CPU (``kdtr_device = "cpu"``). The calling contract is PyCallableKernel's docstring."""

from __future__ import annotations

import importlib
import re
import time

import numpy as np

from kdtr.errors import KernelSpecError
from kdtr.kernels.caps import Caps
from kdtr.kernels.launch import DeviceProblem, cupy_module, synchronize
from kdtr.kernels.launch_types import KernelRuntimeError, RunOutput, to_f32

PY_SPEC = re.compile(r"(?P<module>[A-Za-z_][\w.]*):(?P<attr>[A-Za-z_][\w.]*)")
"""A kernel spec naming a Python callable: ``package.module:callable``."""


class PyCallableKernel:
    """A Python callable ``fn(q, kv_cache, block_table, prefix_lens, tree_mask, *, scale, page_size,
    out_dtype)`` returning out or (out, lse), on cupy arrays, or torch tensors when
    ``fn.kdtr_framework == "torch"``. bf16 arrives as raw uint16 bits (cupy) or torch.bfloat16;
    out_dtype is "fp32" or "bf16"; the tree mask is int32 for torch (torch lacks uint32 ops).

    ``fn.kdtr_device = "cpu"``: no GPU at all; fn gets the numpy arrays as stored (bf16 as
    ml_dtypes.bfloat16, the mask uint32) and returns numpy arrays; ms is the whole call.
    """

    def __init__(self, fn, name: str, caps=None):
        self.fn, self.name = fn, name
        self.framework = getattr(fn, "kdtr_framework", "cupy")
        self.device = getattr(fn, "kdtr_device", "cuda")
        self.caps = getattr(fn, "kdtr_caps", None) or caps
        self.writes_lse = bool(getattr(fn, "kdtr_writes_lse", True))

    def _run_cpu(self, problem, out_dtype: str) -> RunOutput:
        problem.validate()
        args = [np.ascontiguousarray(a) for a in (problem.q, problem.kv_cache)] + [
            np.ascontiguousarray(a, t) for a, t in ((problem.block_table, np.int32), (problem.prefix_lens, np.int32),
                                                    (problem.tree_mask, np.uint32))]
        t0 = time.perf_counter()
        try:
            res = self.fn(*args, scale=float(problem.scale), page_size=problem.page_size, out_dtype=out_dtype)
        except Exception as e:
            raise KernelRuntimeError(f"{self.name}: {type(e).__name__}: {e}") from e
        ms = (time.perf_counter() - t0) * 1e3
        out, lse = res if isinstance(res, (tuple, list)) else (res, None)
        return RunOutput(to_f32(out), None if lse is None else to_f32(lse), ms)

    def run(self, problem, out_dtype: str) -> RunOutput:
        if self.device == "cpu":
            return self._run_cpu(problem, out_dtype)
        cp = cupy_module()
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
        synchronize(cp, self.name)
        out, lse = res if isinstance(res, (tuple, list)) else (res, None)
        return RunOutput(
            to_f32(out), None if lse is None else to_f32(lse),
            float(cp.cuda.get_elapsed_time(start, stop)),
        )


def python_kernel(spec: str):
    """The PyCallableKernel that ``module:callable`` names; KernelSpecError (one line) when it names none."""
    m = PY_SPEC.fullmatch(spec)
    module_name, attr = m["module"], m["attr"]
    try:
        obj = importlib.import_module(module_name)
    except Exception as e:  # ImportError, or anything the module raises while importing
        msg = " ".join(str(e).split()) or type(e).__name__
        raise KernelSpecError(f"{spec}: cannot import module {module_name!r}: {msg}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise KernelSpecError(f"{spec}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise KernelSpecError(f"{spec}: {attr!r} is a {type(obj).__name__}, not a callable")
    device = getattr(obj, "kdtr_device", "cuda")
    if device not in ("cuda", "cpu"):
        raise KernelSpecError(f"{spec}: kdtr_device must be 'cuda' or 'cpu', got {device!r}")
    return PyCallableKernel(obj, spec, caps=Caps(needs_gpu=device == "cuda"))
