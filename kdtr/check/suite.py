"""The verify run: check the kernel can run at all (preflight), then judge every bundle, in this
process or each case in a child (kdtr/check/isolate.py), into one VerifyReport; with ``graph`` each case
is also captured and replayed as a server's CUDA graph (kdtr/check/graph.py)."""

from __future__ import annotations

import platform
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kdtr.check.case import CaseResult, verify_bundle
from kdtr.check.graph import siblings, verify_graph
from kdtr.check.compare import Status
from kdtr.errors import InputError
from kdtr.golden.bundle import load_bundle
from kdtr.golden.tolerances import check_overrides


def preflight(kernel) -> None:
    """Fail fast, as bad input, before any case runs: a CUDA kernel that does not compile (checked
    through NVRTC, which needs no GPU) or a GPU kernel on a machine without one."""
    from kdtr.kernels import launch, nvrtc

    source, expr_of = getattr(kernel, "source", None), getattr(kernel, "name_expression", None)
    if source is not None and expr_of is not None and nvrtc.available():
        caps = kernel.caps
        expr = expr_of(caps.kv_dtypes[0], caps.out_dtypes[0])
        arch = launch.device_arch() if launch.gpu_available() else "sm_90"
        try:
            nvrtc.compile_file(source, [expr], arch=arch, options=getattr(kernel, "options", ()))
        except nvrtc.CompileError as e:
            first = next((ln.strip() for ln in str(e).splitlines() if "error" in ln), str(e).splitlines()[0])
            raise InputError(f"{kernel.name}: does not compile for {arch}: {first}; fix the source or the symbol") from None
    if kernel.caps.needs_gpu and not launch.gpu_available():
        raise InputError(f"{kernel.name} needs a CUDA GPU ({launch.gpu_unavailable_reason()}); run it on a GPU "
                         "machine, or verify the CPU emulation with -k emulate-flash")



@dataclass
class VerifyReport:
    """Every case of one `kdtr verify` run."""

    kernel: str
    """Kernel spec as given."""
    results: list[CaseResult]
    """One per bundle, in input order."""
    seconds: float
    """Wall time of the whole run."""
    device: str = "cpu"
    """Where the kernel ran, one line for the table's title: "NVIDIA H200 sm_90, driver 580.159,
    NVRTC 13.0, cupy 14.2" or "cpu, Python 3.12.3, numpy 2.2.6" (describe_device)."""
    device_info: dict = field(default_factory=dict)
    """The same in full: kind ("cuda" or "cpu") and, for a GPU, kdtr.kernels.launch.device_info()."""
    isolated: bool = False
    """Each case ran in its own child process."""
    sanitizer: str | None = None
    """compute-sanitizer tool every case ran under, or None."""
    lse_checked: bool = True
    """False for a kernel that does not write lse (kdtr_writes_lse = False): only out was judged."""
    graph: bool = False
    """verify --graph: each case was also captured and replayed (CaseResult.captures)."""
    planned: int | None = None
    """Cases asked for (None: as many as ``results``); more than ``results`` where the run was stopped (Ctrl-C,
    SIGTERM) before the rest ran."""

    @property
    def partial(self) -> bool:
        return self.planned is not None and len(self.results) < self.planned

    @property
    def counts(self) -> dict[str, int]:
        c: dict[str, int] = {}
        for r in self.results:
            c[r.status.value] = c.get(r.status.value, 0) + 1
        return c

    @property
    def failed(self) -> bool:
        """Any case failed, none passed (a run that verified nothing is not a pass) or some never ran (partial)."""
        return (any(r.status.failed for r in self.results) or not any(r.status.ok for r in self.results)
                or self.partial)

    def to_json(self) -> dict:
        return {
            "kernel": self.kernel, "device": self.device, "device_info": self.device_info, "seconds": self.seconds,
            "counts": self.counts, "failed": self.failed, "isolated": self.isolated, "sanitizer": self.sanitizer,
            "lse_checked": self.lse_checked, "graph": self.graph, "results": [r.to_json() for r in self.results],
            **({"partial": {"verified": len(self.results), "of": self.planned}} if self.partial else {}),
        }


def run_verify(kernel, paths: list[Path], repeat: int = 1, overrides: dict | None = None, on_case=None, *,
               isolate: bool = False, timeout: float | None = None, sanitize: str | None = None,
               spec: str | None = None, graph: bool = False, checkpoint=None) -> VerifyReport:
    """Verify `kernel` (a kdtr.kernels kernel object) on every bundle path.

    isolate: run each case in a child process (kdtr.isolate) that re-resolves the kernel from
    ``spec`` (default: kernel.name, which is the spec of every kernel resolve_kernel returns);
    a crash is RUNTIME_ERROR, no result within ``timeout`` seconds (None: kdtr.isolate's
    default_timeout per case) is TIMEOUT. sanitize: a compute-sanitizer tool (memcheck,
    racecheck, initcheck, synccheck) to run each child under; implies isolate. InputError
    when it is unknown or compute-sanitizer is not installed, or when a tolerance override could
    not fail (NaN, infinite, negative: kdtr.golden.tolerances.check_overrides), before any case runs.
    graph: verify --graph (kdtr/check/graph.py); each case's sibling capture is the previous bundle of
    ``paths`` with the same buffers, handed to an isolated child by its path.
    checkpoint: called with the report so far (partial) after every case but the last. A KeyboardInterrupt
    (Ctrl-C; SIGTERM under kdtr.cli.options.stop_on_sigterm) ends the run: the report holds the cases done
    and is partial, which counts as failed.
    """
    check_overrides(overrides)
    t0 = time.perf_counter()
    isolate = isolate or bool(sanitize)
    if isolate:
        from kdtr.check import isolate as iso

        sanitizer = iso.sanitizer_command(sanitize) if sanitize else None
    results = []
    sibs = siblings(paths) if graph else [None] * len(paths)

    def report() -> VerifyReport:
        device, info = describe_device(kernel, results)
        return VerifyReport(kernel.name, list(results), time.perf_counter() - t0, device, info, isolated=isolate,
                            sanitizer=sanitize or None, lse_checked=bool(kernel.writes_lse), graph=graph,
                            planned=len(paths))

    try:
        for path, sib in zip(paths, sibs):
            if isolate:
                r = iso.run_case(kernel, spec or kernel.name, path, repeat, overrides, timeout, sanitizer,
                                 graph=graph, sibling=sib)
            elif graph:
                r = verify_graph(kernel, load_bundle(path), repeat, overrides, load_bundle(sib) if sib else None)
            else:
                r = verify_bundle(kernel, load_bundle(path), repeat=repeat, overrides=overrides)
            results.append(r)
            if on_case:
                on_case(r)
            if checkpoint and len(results) < len(paths):
                checkpoint(report())
    except KeyboardInterrupt:
        pass
    return report()


def describe_device(kernel, results: list[CaseResult]) -> tuple[str, dict]:
    """(one line, full dict) for where ``kernel`` ran. The GPU is asked only when a GPU kernel ran
    a case (a CPU kernel's run never imports cupy); a GPU kernel that skipped every case ran nowhere."""
    if not kernel.caps.needs_gpu:
        info = {"kind": "cpu", "machine": platform.machine(), "python_version": platform.python_version(),
                "numpy_version": np.__version__}
        return f"cpu, Python {info['python_version']}, numpy {info['numpy_version']}", info
    if all(r.status is Status.SKIPPED for r in results):
        return "GPU kernel, no case ran", {"kind": "cuda", "ran": False}
    from kdtr.kernels import launch

    info = {"kind": "cuda", **launch.device_info()}
    driver = _nvidia_driver()
    if driver:
        info["nvidia_driver"] = driver
    cuda = info.get("driver_version")
    parts = [f"{info.get('name')} {info.get('cc')}",
             f"driver {driver}" if driver else (f"CUDA driver {cuda // 1000}.{cuda % 1000 // 10}" if cuda else None),
             f"NVRTC {info['nvrtc_version']}" if info.get("nvrtc_version") else None,
             f"cupy {info['cupy_version']}" if info.get("cupy_version") else None]
    return ", ".join(p for p in parts if p), info


def _nvidia_driver(path: str = "/proc/driver/nvidia/version") -> str | None:
    """The NVIDIA kernel driver's version ("580.159"), where Linux shows it; else None."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    m = re.search(r"Kernel Module\s+(?:for \S+\s+)?([0-9]+(?:\.[0-9]+)+)", text)
    return m.group(1) if m else None
