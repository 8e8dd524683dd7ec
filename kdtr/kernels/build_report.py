"""What ptxas says about a CUDA kernel's builds, per arch, without a GPU: `kdtr compile`.

A kernel that spills to local memory, or whose wgmma chain ptxas serializes, still passes verify
and is silently several times slower; sm_120's 99 KB and 255-register limits differ from
Hopper's. NVRTC compiles for every arch on any machine, so this report is where a kernel author
(and CI) sees registers, shared memory, stack and spills per arch before any GPU time is spent.
docs/PERF.md's resource table is this module's output.
"""

from __future__ import annotations

import enum
import os
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kdtr.kernels import cubin, registry as kernels, nvrtc
from kdtr.kernels.bugs import Bug
from kdtr.kernels.flash.arch import SM_90, SM_120
from kdtr.inputs.presets import DTYPES

ARCH_RE = re.compile(r"sm_\d+a?")
SMEM_OPTIN_BYTES = {"sm_80": 163 * 1024, "sm_86": 99 * 1024, "sm_89": 99 * 1024, "sm_90": SM_90.smem_per_cta,
                    "sm_90a": SM_90.smem_per_cta, "sm_120": SM_120.smem_per_cta}
"""Shared memory one block may opt into, per arch (CUDA programming guide, compute capabilities 8.0,
8.6, 8.9, 9.0 and 12.0; Hopper's and sm_120's from the residency table, kdtr/kernels/flash/arch.py); builds for
other archs are not held against a limit."""


class BuildStatus(str, enum.Enum):
    """How one kernel came out of one build; every status but CLEAN and STACK fails the report."""

    CLEAN = "CLEAN"
    STACK = "STACK"
    """A stack frame but no spills: local arrays or calls (printf); worth a look, not a failure."""
    SPILLS = "SPILLS"
    SMEM_OVER_LIMIT = "SMEM_OVER_LIMIT"
    """Static plus launch-time dynamic shared memory above what the arch lets one block have."""
    WGMMA_SERIALIZED = "WGMMA_SERIALIZED"
    """ptxas serialized the kernel's wgmma or injected a wait (C7514 / C7515 / C7517)."""
    COMPILE_ERROR = "COMPILE_ERROR"

    @property
    def failed(self) -> bool:
        return self not in (BuildStatus.CLEAN, BuildStatus.STACK)


@dataclass(frozen=True)
class BuildTarget:
    """One source compiled for some archs with some name expressions (one NVRTC run per arch)."""

    label: str
    """The kernel spec it came from (table label)."""
    source: Path
    """The .cu file."""
    names: tuple[str, ...]
    """Name expressions instantiated in the one compilation."""
    archs: tuple[str, ...]
    """NVRTC targets, e.g. sm_80 or sm_90a."""
    variant: object = None
    """A built-in flash kernel's FlashVariant (its config array gives each kernel's dynamic shared
    memory); None: the file's kdtr_launch constants (the user-kernel contract of kdtr_abi.h)."""

    def __post_init__(self):
        if not self.names or not self.archs:
            raise ValueError(f"{self.label}: nothing to compile (names {self.names}, archs {self.archs})")


@dataclass(frozen=True)
class BuildRow:
    """ptxas's report for one kernel of one build."""

    label: str
    """The kernel spec."""
    kernel: str
    """Name expression (a compile error: the source file's name)."""
    arch: str
    """NVRTC target."""
    status: BuildStatus
    """The worst finding for this kernel (see BuildStatus)."""
    resources: nvrtc.Resources = field(default_factory=nvrtc.Resources)
    """Registers, static shared memory, stack, spills and barriers as ptxas reported them."""
    dynamic_smem: int = 0
    """Dynamic shared memory a launch asks for, bytes (from the cubin's kdtr_launch or config array)."""
    smem_limit: int = 0
    """What the arch lets one block have, bytes (SMEM_OPTIN_BYTES; 0: not known here)."""
    message: str = ""
    """The compiler's lines behind a non-CLEAN status (first error, or the ptxas info lines)."""

    def to_json(self) -> dict:
        """One flat dict: the resources' fields beside the row's own."""
        d = {k: v for k, v in asdict(self).items() if k != "resources"}
        return {**d, "status": self.status.value, **asdict(self.resources)}


def parse_archs(text: str | None) -> tuple[str, ...] | None:
    """--arch's comma list (sm_80,sm_90a,...); None for each kernel's own archs."""
    if text is None or not text.strip():
        return None
    archs = tuple(dict.fromkeys(a.strip() for a in text.split(",") if a.strip()))
    bad = [a for a in archs if not ARCH_RE.fullmatch(a)]
    if bad:
        raise ValueError(f"--arch {','.join(bad)}: give NVRTC targets such as sm_80,sm_90,sm_90a,sm_120")
    return archs


def targets_for(spec: str, archs: tuple[str, ...] | None = None, all_variants: bool = False) -> list[BuildTarget]:
    """The builds behind a kernel spec: a built-in's shipped instantiations (its planted-bug ones too
    with all_variants), or a user .cu symbol for each (kv, out) dtype pair. ``archs`` replaces a
    portable kernel's archs; an arch-specific kernel (flash-sm90: sm_90a) must be among them."""
    k = kernels.resolve_kernel(spec)
    source = getattr(getattr(k, "variant", None), "source", None) or getattr(k, "source", None)
    if source is None or not str(source).endswith((".cu", ".cuh")):
        raise kernels.KernelSpecError(f"{spec}: not a CUDA kernel; kdtr compile reports NVRTC builds of .cu kernels")
    if spec.strip() in kernels.builtin_names() or getattr(k, "variant", None) is not None:  # a forced plan: its builds
        bugs = tuple(Bug) if all_variants else (Bug(getattr(k, "bug", 0)),)
        found = [(names, own) for src, names, own in kernels.compile_targets(bugs) if Path(src) == Path(source)]
        names, own = found[0]
        variant = getattr(k, "variant", None)
    else:
        names = list(dict.fromkeys(k.name_expression(kv, out) for kv in DTYPES for out in DTYPES))
        own, variant = kernels.ALL_ARCHS, None
    if archs is not None and len(own) == 1 and own[0].endswith("a"):  # arch-specific: wgmma on sm_90a only
        if own[0] not in archs:
            raise ValueError(f"{spec} builds for {own[0]} only (arch-specific instructions); add it to --arch")
        archs = own
    return [BuildTarget(spec, Path(source), tuple(names), tuple(archs or own), variant)]


def _rows_of(target: BuildTarget, arch: str) -> list[BuildRow]:
    try:
        c = nvrtc.compile_file(target.source, list(target.names), arch)
    except nvrtc.CompileError as e:
        first = (e.errors or str(e).splitlines() or ["compile error"])[0]
        return [BuildRow(target.label, target.source.name, arch, BuildStatus.COMPILE_ERROR, message=first.strip())]
    serialized = nvrtc.wgmma_serialized(c.log)
    limit = SMEM_OPTIN_BYTES.get(arch, 0)
    dynamic_smem = _dynamic_smem(target, c.cubin)
    rows = []
    for name in target.names:
        r = c.resource(name)
        dyn = dynamic_smem(name)
        mine = [ln for ln in serialized if c.lowered[name] in ln or "function '" not in ln]
        if r.spill_stores or r.spill_loads:
            status, msg = BuildStatus.SPILLS, f"{r.spill_stores} B spill stores, {r.spill_loads} B spill loads"
        elif limit and r.shared_bytes + dyn > limit:
            status, msg = BuildStatus.SMEM_OVER_LIMIT, f"{r.shared_bytes + dyn} B shared memory > {arch}'s {limit} B"
        elif mine:
            status, msg = BuildStatus.WGMMA_SERIALIZED, mine[0]
        elif r.stack_frame:
            status, msg = BuildStatus.STACK, f"{r.stack_frame} B stack frame"
        else:
            status, msg = BuildStatus.CLEAN, ""
        rows.append(BuildRow(target.label, name, arch, status, r, dyn, limit, msg))
    return rows


def _dynamic_smem(target: BuildTarget, elf: bytes):
    """name expression -> the dynamic shared memory a launch of that kernel passes, from the build's
    config array (a flash variant) or its kdtr_launch (else 0), read from the cubin once."""
    v = target.variant
    if v is not None:
        config = v.read_config(lambda symbol, n: cubin.global_ints(elf, symbol, n))
        return lambda name: v.dynamic_smem(name, config)
    launch = cubin.global_ints(elf, "kdtr_launch", 4)
    return lambda name: launch[2] if launch else 0


def build_report(targets: list[BuildTarget], jobs: int | None = None) -> list[BuildRow]:
    """Every (target, arch) compiled (the disk cache reused), in parallel threads: NVRTC is
    thread-safe and its ctypes calls drop the GIL. Rows in target, arch, name order."""
    work = [(t, a) for t in targets for a in t.archs]
    with ThreadPoolExecutor(max_workers=max(1, min(len(work), jobs or os.cpu_count() or 1))) as pool:
        return [row for rows in pool.map(lambda ta: _rows_of(*ta), work) for row in rows]
