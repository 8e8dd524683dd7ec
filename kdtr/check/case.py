"""One verify case: run a kernel on a golden bundle and judge every output.

The flow per bundle: can the kernel take it (else SKIPPED, with the reason), run it (outputs
poisoned first by the launcher), compare out and lse with the float64 reference, and with
--repeat require bit-identical re-runs (else RACE). Failures of the kernel itself (compile
errors, CUDA errors) become statuses of that case, never exceptions out of the run.

With ``isolate=True`` (the CLI's default) each case runs in a child process (kdtr.isolate), so a
kernel that segfaults, aborts, traps or hangs fails that case only (RUNTIME_ERROR / TIMEOUT), and
``sanitize`` runs each child under compute-sanitizer (SANITIZER on findings). verify --graph
(kdtr/check/graph.py) judges each capture's replay with the same ``judge`` into a CaptureResult.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kdtr.golden.bundle import Bundle
from kdtr.check.compare import Check, Status, compare, worst_status
from kdtr.golden.tolerances import resolve

@dataclass
class CaptureResult:
    """One capture of a case under verify --graph (kdtr/check/graph.py): where the launch was prepared and
    captured, and how its replays on the case's inputs fared."""

    layout: str
    """Where it was captured: "P=1" (every prefix length 1, a chain tree) or "sibling CASE" (that bundle)."""
    status: Status
    """The replay's verdict by the checks of a direct run, RACE, CAPTURE_ERROR, or the kernel's failure."""
    fill: int | None = None
    """The prefix length every request had at capture; None for a sibling capture."""
    sibling: str | None = None
    """The bundle file captured on, for a sibling capture."""
    message: str = ""
    """Why it failed or skipped, one line."""
    ms: float | None = None
    """The fastest replay's time (device time on a GPU, wall time on the CPU)."""
    checks: list[Check] = field(default_factory=list)
    """The first replay's checks, one per output compared."""

    def to_json(self) -> dict:
        return {"layout": self.layout, "fill": self.fill, "sibling": self.sibling, "status": self.status.value,
                "message": self.message, "ms": self.ms, "checks": [c.to_json() for c in self.checks]}

    @classmethod
    def from_json(cls, d: dict) -> CaptureResult:
        return cls(d["layout"], Status(d["status"]), d.get("fill"), d.get("sibling"), d.get("message") or "",
                   d.get("ms"), [Check.from_json(c) for c in d.get("checks") or []])


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
    captures: list[CaptureResult] = field(default_factory=list)
    """verify --graph: one per capture of the launch (kdtr/check/graph.py); empty without --graph."""
    warnings: list[str] = field(default_factory=list)
    """What did not fail but a reader should know, one line each (a replay much slower than the direct launch)."""

    def to_json(self) -> dict:
        return {
            "case": self.case, "kernel": self.kernel, "status": self.status.value, "shape": self.shape,
            "checks": [c.to_json() for c in self.checks], "message": self.message, "ms": self.ms, "path": self.path,
            "captures": [c.to_json() for c in self.captures], "warnings": list(self.warnings),
        }

    @classmethod
    def from_json(cls, d: dict) -> CaseResult:
        """Inverse of ``to_json``."""
        return cls(d["case"], d["kernel"], Status(d["status"]), dict(d.get("shape") or {}),
                   [Check.from_json(c) for c in d.get("checks") or []], d.get("message") or "", d.get("ms"),
                   d.get("path") or "", [CaptureResult.from_json(c) for c in d.get("captures") or []],
                   list(d.get("warnings") or []))


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
        res.checks = judge(kernel, bundle, first, overrides)
        res.status = worst_status(c.status for c in res.checks)
        res.message = next((c.message for c in res.checks if c.status.failed), "")
        for i in range(1, repeat):
            again = kernel.run(bundle.problem, bundle.out_dtype)
            if not same_outputs(kernel, first, again):
                res.status = worst_status([res.status, Status.RACE])
                res.message = f"repeat {i + 1} of {repeat} differs bitwise from the first run (a race)"
                break
    except Exception as e:  # the kernel's failure is this case's status, never the run's end
        res.status, res.message = classify_error(e)
    return res


def judge(kernel, bundle: Bundle, got, overrides: dict | None = None) -> list[Check]:
    """The checks of one run's outputs (a RunOutput) against the bundle's reference: out, and lse where the
    kernel writes it, each with its calibrated tolerance (and the user's overrides)."""
    outputs = [("out", got.out, bundle.out)]
    if kernel.writes_lse:
        outputs.append(("lse", got.lse, bundle.lse))
    checks = []
    cond = bundle.bounds_conditioning  # recorded max |s|, capped by the data
    for name, have, want in outputs:
        tol = resolve(bundle.kv_dtype, bundle.out_dtype, name, bundle.tolerances, (overrides or {}).get(name), cond)
        dtype = bundle.out_dtype if name == "out" else "fp32"
        chk = compare(have, want, tol, name, depth=bundle.problem.tree_depth, out_dtype=dtype)
        if have is None and (fix := getattr(kernel, "missing_output_fix", None)):  # a callable returned less
            chk.message = f"{chk.message}: {fix(name)}"
        checks.append(chk)
    return checks


def same_outputs(kernel, a, b) -> bool:
    """Two runs (RunOutput) gave the same bits in every output the kernel writes."""
    return _same_bits(a.out, b.out) and (not kernel.writes_lse or _same_bits(a.lse, b.lse))


def classify_error(e: Exception) -> tuple[Status, str]:
    kind = type(e).__name__
    if kind == "CompileError":
        return Status.COMPILE_ERROR, str(e).strip()
    if kind == "CaptureError":
        return Status.CAPTURE_ERROR, " ".join(str(e).split())[:500]
    if kind in ("KernelTimeout", "TimeoutError"):
        return Status.TIMEOUT, str(e).strip()
    text = " ".join(str(e).split())
    return Status.RUNTIME_ERROR, f"{kind}: {text}"[:500]


def _same_bits(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    if a is None or b is None:
        return a is b
    return a.shape == b.shape and np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes()
