"""Verification: run a kernel on golden bundles and judge every output.

The flow per bundle: can the kernel take it (else SKIPPED, with the reason), run it (outputs
poisoned first by the launcher), compare out and lse with the float64 reference, and with
--repeat require bit-identical re-runs (else RACE). Failures of the kernel itself (compile
errors, CUDA errors) become statuses of that case, never exceptions out of the run.

With ``isolate=True`` (the CLI's default) each case runs in a child process (kdtr.isolate), so a
kernel that segfaults, aborts, traps or hangs fails that case only (RUNTIME_ERROR / TIMEOUT), and
``sanitize`` runs each child under compute-sanitizer (SANITIZER on findings).
"""

from __future__ import annotations

import glob as globlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kdtr import suites
from kdtr.bundle import Bundle, load_bundle
from kdtr.compare import Check, Status, compare, worst_status
from kdtr.tolerances import resolve

REPO_GOLDENS = Path(__file__).resolve().parent.parent / "goldens"


class InputError(ValueError):
    """Bad user input (no bundles found, unknown suite...): one line, exit code 2."""


@dataclass
class CaseResult:
    """The verdict on one (kernel, bundle) pair."""

    case: str
    """Bundle case name."""
    kernel: str
    """Kernel name as resolved."""
    status: Status
    """Overall status (the worst of the checks, or the kernel's own failure)."""
    shape: dict = field(default_factory=dict)
    """B, T, H, P range, page size, dtypes, tree family."""
    checks: list[Check] = field(default_factory=list)
    """One per output compared (out, and lse when the kernel writes it)."""
    message: str = ""
    """Why it skipped or failed, one line (compiler / CUDA error text for those statuses)."""
    ms: float | None = None
    """Kernel time of the first run as the launcher measured it (not a benchmark)."""
    path: str = ""
    """Bundle file."""

    def to_json(self) -> dict:
        return {
            "case": self.case, "kernel": self.kernel, "status": self.status.value, "shape": self.shape,
            "checks": [c.to_json() for c in self.checks], "message": self.message, "ms": self.ms, "path": self.path,
        }

    @classmethod
    def from_json(cls, d: dict) -> CaseResult:
        """Inverse of ``to_json``."""
        return cls(d["case"], d["kernel"], Status(d["status"]), dict(d.get("shape") or {}),
                   [Check.from_json(c) for c in d.get("checks") or []], d.get("message") or "", d.get("ms"),
                   d.get("path") or "")


def find_bundles(sources: list[str], cache_dir: str | os.PathLike | None = None, jobs: int = 1,
                 force: bool = False) -> list[Path]:
    """Bundles from files, directories, globs or suite names (generated into a cache if missing).

    force: go ahead with generating a suite even where generation's own checks would refuse.
    """
    found: list[Path] = []
    for src in sources:
        p = Path(src)
        if src in suites.SUITES:
            found += suite_bundles(src, cache_dir, jobs, force=force)
        elif p.is_dir():
            hits = sorted(p.rglob("*.kdtr"))
            if not hits:
                raise InputError(f"{src}: directory holds no .kdtr bundles (generate some with `kdtr gen`)")
            found += hits
        elif p.is_file():
            found.append(p)
        elif any(ch in src for ch in "*?["):
            hits = sorted(Path(h) for h in globlib.glob(src, recursive=True) if h.endswith(".kdtr"))
            if not hits:
                raise InputError(f"{src}: pattern matches no .kdtr bundles")
            found += hits
        else:
            raise InputError(f"{src}: no such bundle, directory or suite (suites: {', '.join(suites.SUITES)})")
    seen, uniq = set(), []
    for f in found:
        if f.resolve() not in seen:
            seen.add(f.resolve())
            uniq.append(f)
    return uniq


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    root = cache_dir or os.environ.get("KDTR_CACHE_DIR") or Path.home() / ".cache" / "kdtr"
    return Path(root)


def suite_bundles(name: str, cache_dir=None, jobs: int = 1, force: bool = False) -> list[Path]:
    """The bundle files of a suite: committed goldens where present, else generated on demand.

    force: generate even where the memory check (kdtr.resources) would refuse.
    """
    from kdtr.generate import generate

    specs = suites.suite(name)
    committed = REPO_GOLDENS / name
    if name in suites.COMMITTED and all((committed / f"{s.name}.kdtr").exists() for s in specs):
        return [committed / f"{s.name}.kdtr" for s in specs]
    out = cache_root(cache_dir) / "suites" / name
    missing = [s for s in specs if not (out / f"{s.name}.kdtr").exists()]
    if missing:
        generate(missing, out, jobs=jobs, force=force)
    return [out / f"{s.name}.kdtr" for s in specs]


def preflight(kernel) -> None:
    """Fail fast, as bad input, before any case runs: a CUDA kernel that does not compile (checked
    through NVRTC, which needs no GPU) or a GPU kernel on a machine without one."""
    from kdtr import launch, nvrtc

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


def shape_of(b: Bundle) -> dict:
    p = b.problem
    return {
        "B": p.B, "T": p.T, "H": p.H, "P_min": int(p.prefix_lens.min()), "P_max": int(p.prefix_lens.max()),
        "page": p.page_size, "kv": p.kv_dtype, "out": b.out_dtype, "tree": b.tree_family,
    }


def new_result(kernel, bundle: Bundle) -> CaseResult:
    """A PASS result for (kernel, bundle) to fill in, or SKIPPED (with the reason) when the kernel
    does not take this bundle."""
    res = CaseResult(bundle.name, kernel.name, Status.PASS, shape_of(bundle), path=str(bundle.path or ""))
    why = kernel.caps.why_not(bundle.problem, bundle.out_dtype)
    if why:
        res.status, res.message = Status.SKIPPED, why
    return res


def verify_bundle(kernel, bundle: Bundle, repeat: int = 1, overrides: dict | None = None) -> CaseResult:
    """Verify in this process (a kernel that crashes the process takes the run with it)."""
    res = new_result(kernel, bundle)
    if res.status is Status.SKIPPED:
        return res
    try:
        first = kernel.run(bundle.problem, bundle.out_dtype)
        res.ms = first.ms
        outputs = [("out", first.out, bundle.out)]
        if kernel.writes_lse:
            outputs.append(("lse", first.lse, bundle.lse))
        for name, got, want in outputs:
            tol = resolve(bundle.kv_dtype, bundle.out_dtype, name, bundle.tolerances, (overrides or {}).get(name))
            res.checks.append(compare(got, want, tol, name, depth=bundle.problem.tree_depth))
        res.status = worst_status(c.status for c in res.checks)
        res.message = next((c.message for c in res.checks if c.status.failed), "")
        for i in range(1, repeat):
            again = kernel.run(bundle.problem, bundle.out_dtype)
            if not _same_bits(first.out, again.out) or (kernel.writes_lse and not _same_bits(first.lse, again.lse)):
                res.status = worst_status([res.status, Status.RACE])
                res.message = f"run {i + 1} of {repeat} differs bitwise from run 1 (a race)"
                break
    except Exception as e:  # the kernel's failure is this case's status, never the run's end
        res.status, res.message = classify_error(e)
    return res


def classify_error(e: Exception) -> tuple[Status, str]:
    kind = type(e).__name__
    if kind == "CompileError":
        return Status.COMPILE_ERROR, str(e).strip()
    if kind in ("KernelTimeout", "TimeoutError"):
        return Status.TIMEOUT, str(e).strip()
    text = " ".join(str(e).split())
    return Status.RUNTIME_ERROR, f"{kind}: {text}"[:500]


def _same_bits(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    if a is None or b is None:
        return a is b
    return a.shape == b.shape and np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes()


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
    """Where the kernel ran."""
    isolated: bool = False
    """Each case ran in its own child process."""
    sanitizer: str | None = None
    """compute-sanitizer tool every case ran under, or None."""

    @property
    def counts(self) -> dict[str, int]:
        c: dict[str, int] = {}
        for r in self.results:
            c[r.status.value] = c.get(r.status.value, 0) + 1
        return c

    @property
    def failed(self) -> bool:
        """Any case failed, or none passed (a run that verified nothing is not a pass)."""
        return any(r.status.failed for r in self.results) or not any(r.status.ok for r in self.results)

    def to_json(self) -> dict:
        return {
            "kernel": self.kernel, "device": self.device, "seconds": self.seconds, "counts": self.counts,
            "failed": self.failed, "isolated": self.isolated, "sanitizer": self.sanitizer,
            "results": [r.to_json() for r in self.results],
        }


def run_verify(kernel, paths: list[Path], repeat: int = 1, overrides: dict | None = None, on_case=None, *,
               isolate: bool = False, timeout: float | None = None, sanitize: str | None = None,
               spec: str | None = None) -> VerifyReport:
    """Verify `kernel` (a kdtr.kernels kernel object) on every bundle path.

    isolate: run each case in a child process (kdtr.isolate) that re-resolves the kernel from
    ``spec`` (default: kernel.name, which is the spec of every kernel resolve_kernel returns);
    a crash is RUNTIME_ERROR, no result within ``timeout`` seconds (None: kdtr.isolate's
    default_timeout per case) is TIMEOUT. sanitize: a compute-sanitizer tool (memcheck,
    racecheck, initcheck, synccheck) to run each child under; implies isolate. InputError
    when it is unknown or compute-sanitizer is not installed.
    """
    t0 = time.perf_counter()
    isolate = isolate or bool(sanitize)
    if isolate:
        from kdtr import isolate as iso

        sanitizer = iso.sanitizer_command(sanitize) if sanitize else None
    results = []
    for path in paths:
        if isolate:
            r = iso.run_case(kernel, spec or kernel.name, path, repeat, overrides, timeout, sanitizer)
        else:
            r = verify_bundle(kernel, load_bundle(path), repeat=repeat, overrides=overrides)
        results.append(r)
        if on_case:
            on_case(r)
    return VerifyReport(kernel.name, results, time.perf_counter() - t0, getattr(kernel, "device", "cpu"),
                        isolated=isolate, sanitizer=sanitize or None)
