"""The kernel registry: built-in kernels by name, user kernels by file or import path.

A kernel spec is one of
  * a built-in name: ``naive``, ``emulate-flash``, ``flash`` (mma.sync: sm_80, sm_90, sm_120),
    ``flash-sm90`` (wgmma: sm_90 GPUs only), or ``<name>-bug=<slug>`` for each planted bug of kdtr/kernels/bugs.py (the name doubles as the test
    id and the table label);
  * ``path/to/file.cu:symbol``: a CUDA kernel taking ``const KdtrParams`` (contract in
    cuda/kdtr_abi.h; ``{kv}`` / ``{out}`` in the symbol pick the dtypes);
  * ``package.module:callable``: a Python callable on cupy arrays or torch tensors, or on numpy
    arrays without a GPU when it has ``kdtr_device = "cpu"`` (kdtr/kernels/python.py
    documents the signature).
"""

from __future__ import annotations

import difflib
import re
import time
from pathlib import Path
from typing import Callable, Protocol, runtime_checkable

import numpy as np

from kdtr.kernels.flash import kernel as flash, plan as flash_plan
from kdtr.kernels.bugs import Bug
from kdtr.errors import KernelSpecError
from kdtr.kernels import python
from kdtr.kernels.caps import Caps
from kdtr.kernels.launch import CTYPES, CudaKernel, RunOutput
from kdtr.kernels.nvrtc import CUDA_DIR
from kdtr.inputs.presets import DTYPES


@runtime_checkable
class Kernel(Protocol):
    """What verify and bench need from a kernel."""

    name: str
    caps: Caps
    writes_lse: bool

    def run(self, problem, out_dtype: str) -> RunOutput: ...


class EmulateKernel:
    """The CPU flash emulation (kdtr.emulate): the bf16 tiled algorithm in numpy, GPU-free for CI."""

    writes_lse = True
    CAPS = Caps(kv_dtypes=("bf16",), needs_gpu=False)
    """It emulates a bf16 tensor-core kernel: bf16 storage only, like the kernel it mirrors."""

    def __init__(self, name: str, bug: Bug = Bug.NONE):
        self.name, self.bug, self.caps = name, Bug(bug), self.CAPS

    def run(self, problem, out_dtype: str) -> RunOutput:
        from kdtr.kernels.emulate import emulate_flash  # written separately; imported on first use

        t0 = time.perf_counter()
        out, lse = emulate_flash(problem, out_dtype, bug=self.bug)
        ms = (time.perf_counter() - t0) * 1e3
        return RunOutput(np.asarray(out, np.float32), np.asarray(lse, np.float32), ms)


# ---- built-ins ---------------------------------------------------------------------------------

NAIVE_SOURCE = CUDA_DIR / "naive.cu"
NAIVE_TEMPLATE = "kdtr_naive_verify<{kv}, {out}, {bug}>"

# The fast kernels: cuda/flash.cu (mma.sync) and cuda/flash_sm90.cu (wgmma), their launch plan
# and two launches in kdtr/kernels/flash/kernel.py (FlashKernel, one FlashVariant each).
FLASH_CAPS = Caps(kv_dtypes=("bf16",), max_T=1280)
"""bf16 storage only (tensor cores); any page size; T up to the kernel's MAX_T (a test keeps them equal)."""
FLASH90_CAPS = Caps(kv_dtypes=("bf16",), max_T=1280, archs=("sm_90",))
"""As FLASH_CAPS, on Hopper only: wgmma exists on sm_90a alone."""
FLASH_VARIANTS = {"flash": (flash.MMA, FLASH_CAPS), "flash-sm90": (flash.SM90, FLASH90_CAPS)}
"""Base name -> (FlashVariant, Caps)."""
ALL_ARCHS = ("sm_80", "sm_90", "sm_120")
"""What CI compiles the portable kernels for (no GPU needed); an arch-specific one (variant.arch) for its own."""


def _flash(name: str, base: str, bug: Bug) -> Kernel:
    variant, caps = FLASH_VARIANTS[base]
    return flash.FlashKernel(name, caps, bug, variant)


def flash90_build(label: str, options: str = "") -> Kernel:
    """flash-sm90 compiled with extra NVRTC options, e.g. its -D experiment knobs (scripts/sm90_ablate.py)."""
    return flash.FlashKernel(label, FLASH90_CAPS, Bug.NONE, flash.SM90, tuple(options.split()))


BASES = ("naive", "emulate-flash", "flash", "flash-sm90")


def variant_name(base: str, bug: Bug) -> str:
    """``base`` for the correct kernel, ``base-bug=<slug>`` for a planted bug."""
    return base if bug is Bug.NONE else f"{base}-bug={bug.slug}"


def _registry() -> dict[str, Callable[[], Kernel]]:
    reg: dict[str, Callable[[], Kernel]] = {}
    for base in BASES:
        for bug in Bug:
            name = variant_name(base, bug)
            if base == "naive":
                reg[name] = lambda n=name, b=bug: CudaKernel(n, NAIVE_SOURCE, NAIVE_TEMPLATE, None, b, Caps())
            elif base == "emulate-flash":
                reg[name] = lambda n=name, b=bug: EmulateKernel(n, b)
            else:
                reg[name] = lambda n=name, base=base, b=bug: _flash(n, base, b)
    return reg


def builtin_names() -> list[str]:
    return list(_registry())


def compile_targets(bugs=tuple(Bug)) -> list[tuple[Path, list[str], tuple[str, ...]]]:
    """(source, every name expression, archs) of each built-in CUDA kernel with planted bugs ``bugs``
    (all of them: what CI compiles; ``(Bug.NONE,)``: the kernels as shipped, what `kdtr compile` shows)."""
    naive = [NAIVE_TEMPLATE.format(kv=CTYPES[kv], out=CTYPES[o], bug=int(b)) for kv in DTYPES for o in DTYPES for b in bugs]
    targets = [(NAIVE_SOURCE, naive, ALL_ARCHS)]
    for variant, _ in FLASH_VARIANTS.values():
        merges = (0, 1) if variant.merges_in_kernel else (0,)
        merges += (2,) if variant.tile_ns else ()  # segments: the work table (kdtr/kernels/flash/schedule.py)
        xrs = (0, variant.extra_rows, flash_plan.XR_ONLY) if variant.extra_rows else (0,)
        exprs = [variant.main.format(mt=mt, out=CTYPES[o], bug=int(b), merge=m, xr=x)
                 for mt in variant.mts for o in DTYPES for b in bugs for m in merges for x in xrs
                 if not (m and x)]  # transposed rows never merge in-kernel (kdtr/kernels/flash/plan.py)
        combine = [flash_plan.COMBINE.format(out=CTYPES[o]) for o in DTYPES]
        combine += [flash_plan.COMBINE_ROWS.format(out=CTYPES[o], parts=n) for o in DTYPES for n in flash_plan.ROWS_PARTS]
        combine += [flash_plan.COMBINE_NARROW.format(out=CTYPES[o], cols=c, warps=w)
                    for o in DTYPES for c in flash_plan.NARROW_COLS for w in flash_plan.NARROW_WARPS]
        if variant.tile_ns:  # takes segments: their merge too
            combine += [flash_plan.COMBINE_JOBS.format(out=CTYPES[o], rows=16 * mt) for o in DTYPES for mt in variant.mts]
        targets.append((variant.source, exprs + combine, (variant.arch,) if variant.arch else ALL_ARCHS))
    return targets


# ---- resolving a spec --------------------------------------------------------------------------

_CUDA_SPEC = re.compile(r"(?P<path>.+\.(?:cu|cuh))(?::(?P<symbol>.*))?")


def resolve_kernel(spec: str) -> Kernel:
    """The kernel a spec names; KernelSpecError (one line) when it names nothing runnable."""
    spec = spec.strip()
    reg = _registry()
    if spec in reg:
        return reg[spec]()
    if m := re.fullmatch(r"(?P<base>[\w-]+?)-bug=(?P<bug>.+)", spec):
        if m["base"] in BASES and variant_name(m["base"], Bug.NONE) in reg:
            try:
                return reg[variant_name(m["base"], Bug.parse(m["bug"]))]()
            except ValueError as e:
                raise KernelSpecError(f"{spec}: {e}") from None
    if m := _CUDA_SPEC.fullmatch(spec):
        path, symbol = Path(m["path"]), (m["symbol"] or "").strip()
        if not path.is_file():
            raise KernelSpecError(f"{spec}: no such CUDA file {str(path)!r}")
        if not symbol:
            raise KernelSpecError(f"{spec}: name the kernel, e.g. {path}:my_verify or {path}:my_verify<{{kv}}, {{out}}>")
        return CudaKernel(spec, path, symbol, None, Bug.NONE, Caps())
    if python.PY_SPEC.fullmatch(spec):
        return python.python_kernel(spec)
    hint = difflib.get_close_matches(spec, reg, n=1)
    bases = [b for b in BASES if b in reg]
    raise KernelSpecError(
        f"unknown kernel {spec!r}" + (f" (did you mean {hint[0]!r}?)" if hint else "")
        + f"; known: {', '.join(bases)}, each also as NAME-bug=BUG with BUG one of "
        + f"{', '.join(b.slug for b in Bug if b is not Bug.NONE)}; or FILE.cu:SYMBOL, or MODULE:CALLABLE"
    )


__all__ = [
    "BASES", "Caps", "EmulateKernel", "Kernel", "KernelSpecError", "builtin_names", "compile_targets",
    "resolve_kernel", "variant_name",
]
