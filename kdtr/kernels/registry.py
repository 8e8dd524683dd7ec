"""The kernel registry: built-in kernels by name, user kernels by file or import path.

A kernel spec is one of
  * a built-in name: ``naive``, ``emulate-flash``, ``flash`` (mma.sync: sm_80, sm_90, sm_120),
    ``flash-sm90`` (wgmma: sm_90 GPUs only), or ``<name>-bug=<slug>`` for each planted bug of
    kdtr/kernels/bugs.py (the name doubles as the test id and the table label); a flash kernel may end
    in a plan suffix, ``flash-sm90[xr=1,splits=4]`` (kdtr/kernels/flash/force.py);
  * ``path/to/file.cu:symbol``: a CUDA kernel taking ``const KdtrParams`` (contract in
    cuda/kdtr_abi.h; ``{kv}`` / ``{out}`` in the symbol pick the dtypes);
  * ``package.module:callable`` or ``path/to/file.py:callable``: a Python callable on cupy arrays
    or torch tensors, or on numpy arrays without a GPU when it has ``kdtr_device = "cpu"``
    (kdtr/kernels/python.py documents the signature).
"""

from __future__ import annotations

import difflib
import re
import time
from pathlib import Path
from typing import Callable, Protocol, runtime_checkable

import numpy as np

from kdtr.errors import KernelSpecError
from kdtr.kernels import python
from kdtr.kernels.bugs import Bug, kernel_bug
from kdtr.kernels.caps import Caps
from kdtr.kernels.flash import combine, device_plan, kernel as flash
from kdtr.kernels.flash.force import Force, Merge, RowLayout, parse_force, split_suffix
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
    """The CPU flash emulation (kdtr/kernels/emulate.py): the bf16 tiled algorithm in numpy, GPU-free for CI."""

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

    def graph(self, problem, out_dtype: str):
        """Prepared on host buffers holding ``problem`` and mock-captured (kdtr verify --graph without a GPU):
        a HostGraphRun whose replays run the plan decided here on whatever the buffers then hold."""
        from kdtr.kernels.emulate import capture_emulation

        return capture_emulation(self.name, problem, out_dtype, self.bug)


# ---- built-ins ---------------------------------------------------------------------------------

NAIVE_SOURCE = CUDA_DIR / "naive.cu"
NAIVE_TEMPLATE = "kdtr_naive_verify<{kv}, {out}, {bug}>"

# The fast kernels: cuda/flash.cu (mma.sync) and cuda/flash_sm90.cu (wgmma), their launch plan
# and two launches in kdtr/kernels/flash/kernel.py (FlashKernel, one FlashVariant each).
FLASH_CAPS = Caps(kv_dtypes=("bf16",), max_T=1280)
"""bf16 storage only (tensor cores); any page size; T up to the kernel's MAX_T (a test keeps them equal)."""
FLASH_SM90_CAPS = Caps(kv_dtypes=("bf16",), max_T=1280, archs=("sm_90",))
"""As FLASH_CAPS, on Hopper only: wgmma exists on sm_90a alone."""
FLASH_VARIANTS = {v.label: (v, caps) for v, caps in ((flash.FLASH, FLASH_CAPS), (flash.FLASH_SM90, FLASH_SM90_CAPS))}
"""Base name -> (FlashVariant, Caps)."""
ALL_ARCHS = ("sm_80", "sm_90", "sm_120")
"""What CI compiles the portable kernels for (no GPU needed); an arch-specific one (variant.arch) for its own."""


def _flash(name: str, base: str, bug: Bug, force: Force = Force()) -> Kernel:
    variant, caps = FLASH_VARIANTS[base]
    return flash.FlashKernel(name + force.suffix(), caps, bug, variant, force)


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
    bugs = tuple(dict.fromkeys(kernel_bug(Bug(b)) for b in bugs))  # a launch bug runs the correct build
    naive = [NAIVE_TEMPLATE.format(kv=CTYPES[kv], out=CTYPES[o], bug=int(b)) for kv in DTYPES for o in DTYPES for b in bugs]
    targets = [(NAIVE_SOURCE, naive, ALL_ARCHS)]
    for variant, _ in FLASH_VARIANTS.values():
        merges = (Merge.COMBINE, Merge.IN_KERNEL) if variant.merges_in_kernel else (Merge.COMBINE,)
        merges += (Merge.WORK_TABLE,) if variant.tile_ns else ()  # kdtr/kernels/flash/schedule.py
        xrs = (RowLayout.TILES, RowLayout.EXTRA, RowLayout.TRANSPOSED) if variant.extra_rows else (RowLayout.TILES,)
        exprs = [variant.main.format(mt=mt, out=CTYPES[o], bug=int(b), merge=int(m), xr=int(x))
                 for mt in variant.mts for o in DTYPES for b in bugs for m in merges for x in xrs
                 if m is Merge.COMBINE or x is RowLayout.TILES]  # transposed rows merge by a combine launch
        merge = [combine.COMBINE.format(out=CTYPES[o]) for o in DTYPES]
        merge += [combine.COMBINE_ROWS.format(out=CTYPES[o], parts=n) for o in DTYPES for n in combine.ROWS_PARTS]
        merge += [combine.COMBINE_NARROW.format(out=CTYPES[o], cols=c, warps=w)
                  for o in DTYPES for c in combine.NARROW_COLS for w in combine.NARROW_WARPS]
        if variant.tile_ns:  # takes a work table: its device scheduler and its cut jobs' merge too
            merge += [device_plan.SCHEDULE_KERNEL]
            merge += [combine.COMBINE_JOBS.format(out=CTYPES[o], rows=16 * mt) for o in DTYPES for mt in variant.mts]
        targets.append((variant.source, exprs + merge, (variant.arch,) if variant.arch else ALL_ARCHS))
    return targets


# ---- resolving a spec --------------------------------------------------------------------------

_CUDA_SPEC = re.compile(r"(?P<path>.+\.(?:cu|cuh))(?::(?P<symbol>.*))?")


def resolve_kernel(spec: str) -> Kernel:
    """The kernel a spec names; KernelSpecError (one line) when it names nothing runnable."""
    spec = spec.strip()
    reg = _registry()
    if spec in reg:
        return reg[spec]()
    head, body = split_suffix(spec)
    if body is not None and re.fullmatch(r"[\w-]+(?:-bug=[\w-]+)?", head):
        return _forced(spec, head, body, reg)
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
    raise _unknown(spec, reg)


def _unknown(spec: str, reg) -> KernelSpecError:
    hint = difflib.get_close_matches(spec, reg, n=1)
    bases = [b for b in BASES if b in reg]
    return KernelSpecError(
        f"unknown kernel {spec!r}" + (f" (did you mean {hint[0]!r}?)" if hint else "")
        + f"; known: {', '.join(bases)}, each also as NAME-bug=BUG with BUG one of "
        + f"{', '.join(b.slug for b in Bug if b is not Bug.NONE)}; or FILE.cu:SYMBOL, MODULE:CALLABLE or FILE.py:CALLABLE"
    )


def _forced(spec: str, head: str, body: str, reg) -> Kernel:
    """A flash kernel with a plan suffix: ``head`` a built-in name, ``body`` the KEY=VALUE list between the brackets."""
    if head not in reg:
        kernel = resolve_kernel(head)  # a bad bug name or an unknown kernel says so itself
        head = kernel.name
    base = next((b for b in FLASH_VARIANTS if head == b or head.startswith(f"{b}-bug=")), None)
    if base is None:
        raise KernelSpecError(f"{spec}: a plan suffix [...] applies to the flash kernels only "
                              f"({', '.join(FLASH_VARIANTS)}, and their -bug= variants)")
    bug = Bug.parse(head[len(base) + len("-bug="):]) if head != base else Bug.NONE
    return _flash(head, base, bug, parse_force(spec, body, FLASH_VARIANTS[base][0]))


__all__ = [
    "BASES", "Caps", "EmulateKernel", "Force", "Kernel", "KernelSpecError", "builtin_names", "compile_targets",
    "resolve_kernel", "variant_name",
]
