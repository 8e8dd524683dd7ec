"""`kdtr verify --graph`: each case's launch captured as a serving engine captures it, then replayed on the case.

A server (SGLang, vLLM) captures its verify launch in a CUDA graph once per padded batch size, with dummy
lengths in the buffers (SGLang: 1 for its triton and FA3 backends, 0 for flashinfer, 1024 for flashmla),
and every step writes the real prefix lengths, block tables and tree masks into the same buffers and
replays. Whatever the launch decided on the host from the lengths is frozen (SPEC section 8).

Per case, after the plain verify (which gives the direct launch's time):

1. Capture layouts: the case's buffer shapes with every prefix length at each of FILLS where the block
   table holds fill + T tokens, and a chain tree (node t sees nodes 0..t); plus, where the run holds an
   earlier bundle with the same buffers (``buffer_key``), the previous one as it is (its own lengths and
   trees): "mixed -> mixed", "page-aligned -> ragged".
2. For each: ``kernel.graph(capture problem, out dtype)`` prepares the launch and captures it (a runner);
   ``runner.load(case)`` writes the case's q, cache, block table, lengths and mask into the same buffers;
   ``runner.replay()`` poisons the outputs, replays and downloads. The first replay is judged by the checks
   of a direct run (kdtr/check/case.py's judge); every further replay must give its bits (else RACE).
3. CaptureError (the launch allocates, synchronises or copies to the host) is CAPTURE_ERROR; a kernel
   without ``graph`` (or one that raises kdtr.kernels.python.NoGraph) is SKIPPED, with the reason. A
   replay slower than SLOW_REPLAY x the direct launch is a warning (the status stays).

The case's status is the worst over the direct run and every capture; its message names the capture.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from kdtr.check.case import CaptureResult, CaseResult, classify_error, judge, same_outputs, verify_bundle
from kdtr.check.compare import Status, worst_status
from kdtr.golden.bundle import Bundle, BundleError, read_meta
from kdtr.inputs import trees
from kdtr.inputs.problem import Problem
from kdtr.kernels.python import NoGraph

FILLS = (0, 1, 1024)
"""Dummy prefix lengths servers capture at: flashinfer 0, SGLang's triton and FA3 1, flashmla 1024."""
SLOW_REPLAY = 1.5
"""A replay slower than this many times the direct launch is reported (a warning, not a failure)."""
BROKEN = (Status.COMPILE_ERROR, Status.RUNTIME_ERROR, Status.TIMEOUT)
"""Direct-run statuses after which no capture is tried: it would only fail the same way."""


@dataclass(frozen=True)
class Layout:
    """One problem a case's launch is captured on."""

    label: str
    """How the report names it: "P=1" or "sibling CASE"."""
    problem: Problem
    """Buffers of the case's shapes as they stand at capture."""
    fill: int | None = None
    """The prefix length of every request, for a fill layout."""
    sibling: str | None = None
    """The bundle file, for a sibling layout."""


def buffer_key(meta: dict) -> tuple:
    """What must agree for one bundle's inputs to go into buffers captured on another: B, T, H, page size,
    cache and block-table shapes, dtypes, and the softmax scale (a launch argument fixed at capture, one
    model's constant). From a bundle's metadata (kdtr.golden.bundle.read_meta reads it without the data)."""
    d = meta["dims"]
    return (d["B"], d["T"], d["H"], d["page_size"], d["num_pages"], d["max_pages"], meta["kv_dtype"],
            meta["out_dtype"], float(meta["scale"]))


def siblings(paths: list[Path]) -> list[Path | None]:
    """For each bundle, the previous bundle of the run with the same ``buffer_key`` (None: no such one, or a
    header that does not read: loading that bundle reports why)."""
    last: dict[tuple, Path] = {}
    out: list[Path | None] = []
    for path in paths:
        try:
            key = buffer_key(read_meta(path))
        except (BundleError, OSError, KeyError, TypeError, ValueError):
            out.append(None)
            continue
        out.append(last.get(key))
        last[key] = path
    return out


def fill_problem(problem: Problem, fill: int) -> Problem | None:
    """``problem``'s buffers with every prefix length ``fill`` and a chain tree (mask causal), as a server's
    dummy batch at capture; None where the block table cannot hold fill + T tokens."""
    B, T = problem.B, problem.T
    if fill + T > problem.block_table.shape[1] * problem.page_size:
        return None
    chain = trees.chain(T)
    return replace(problem, prefix_lens=np.full(B, fill, np.int32),
                   tree_parent=np.tile(chain.parent.astype(np.int32), (B, 1)),
                   tree_depth=np.tile(chain.depth.astype(np.int32), (B, 1)),
                   tree_mask=np.tile(chain.mask_words().astype(np.uint32), (B, 1, 1)))


def capture_layouts(bundle: Bundle, sibling: Bundle | None = None) -> list[Layout]:
    """Every problem the case's launch is captured on: each fill that fits, then the sibling bundle."""
    layouts = [Layout(f"P={f}", p, fill=f) for f in FILLS if (p := fill_problem(bundle.problem, f)) is not None]
    if sibling is not None:
        if buffer_key(sibling.meta) != buffer_key(bundle.meta):
            raise ValueError(f"{sibling.name} does not share {bundle.name}'s buffers: no sibling capture")
        layouts.append(Layout(f"sibling {sibling.name}", sibling.problem, sibling=str(sibling.path or sibling.name)))
    return layouts


def p_range(prefix_lens) -> str:
    """Prefix lengths as a short range: "P=0..2500", "P=64"."""
    lo, hi = int(np.min(prefix_lens)), int(np.max(prefix_lens))
    return f"P={lo}" if lo == hi else f"P={lo}..{hi}"


def run_capture(kernel, bundle: Bundle, layout: Layout, replays: int = 2, overrides: dict | None = None) -> CaptureResult:
    """Capture ``kernel`` on ``layout``, load the case, replay ``replays`` times (at least 2) and judge."""
    cap = CaptureResult(layout.label, Status.PASS, layout.fill, layout.sibling)
    try:
        runner = kernel.graph(layout.problem, bundle.out_dtype)
    except NoGraph as e:
        cap.status, cap.message = Status.SKIPPED, str(e)
        return cap
    except Exception as e:  # CaptureError, or the kernel failing to build or run while being prepared
        cap.status, cap.message = classify_error(e)
        return cap
    try:
        runner.load(bundle.problem)
        first = runner.replay()
        cap.checks = judge(kernel, bundle, first, overrides)
        cap.status = worst_status(c.status for c in cap.checks)
        cap.message = next((c.message for c in cap.checks if c.status.failed), "")
        times = [first.ms]
        for i in range(1, max(2, replays)):
            again = runner.replay()
            times.append(again.ms)
            if not same_outputs(kernel, first, again):
                cap.status = worst_status([cap.status, Status.RACE])
                cap.message = f"replay {i + 1} differs bitwise from the first replay (a race)"
                break
        cap.ms = min(t for t in times if t is not None) if any(t is not None for t in times) else None
    except Exception as e:
        cap.status, cap.message = classify_error(e)
    return cap


def slow_replays(kernel, bundle: Bundle, res: CaseResult) -> list[str]:
    """A warning per capture whose fastest replay took more than SLOW_REPLAY x the direct launch. The direct
    run's one time is a single sample, so a suspect is confirmed against the fastest of two more direct runs."""
    if not res.ms or not any(c.ms and c.ms > SLOW_REPLAY * res.ms for c in res.captures):
        return []
    direct = res.ms
    try:
        direct = min([direct] + [kernel.run(bundle.problem, bundle.out_dtype).ms for _ in range(2)])
    except Exception:  # the direct runs passed once: a failure now leaves the first time as the measure
        pass
    return [f"captured at {c.layout}: replay {c.ms:.3g} ms, direct launch {direct:.3g} ms ({c.ms / direct:.1f}x)"
            for c in res.captures if c.ms and c.ms > SLOW_REPLAY * direct]


def verify_graph(kernel, bundle: Bundle, repeat: int = 1, overrides: dict | None = None,
                 sibling: Bundle | None = None) -> CaseResult:
    """The plain verify of the case, then every capture of it (module docstring), in this process."""
    res = verify_bundle(kernel, bundle, repeat=repeat, overrides=overrides)
    if res.status is Status.SKIPPED:
        return res
    if res.status in BROKEN:
        res.message += "; no capture tried (verify --graph)"
        return res
    if getattr(kernel, "graph", None) is None:
        res.captures.append(CaptureResult("-", Status.SKIPPED, message=f"{kernel.name} has no CUDA graph capture "
                                          "(a graph method): verify --graph cannot judge it"))
    else:
        for layout in capture_layouts(bundle, sibling):
            res.captures.append(run_capture(kernel, bundle, layout, max(2, repeat), overrides))
    replayed_at = p_range(bundle.problem.prefix_lens)
    res.warnings += slow_replays(kernel, bundle, res)
    res.status = worst_status([res.status, *(c.status for c in res.captures)])
    bad = [c for c in res.captures if c.status is not Status.PASS]
    if bad and not res.message:
        first = next((c for c in bad if c.status.failed), bad[0])
        where = "" if first.layout == "-" else f"captured at {first.layout}, replayed at {replayed_at}: "
        res.message = f"{where}{first.status.value} {first.message}".strip()
        if len(bad) > 1:
            res.message += f" (and {len(bad) - 1} more of {len(res.captures)} captures: " \
                           + ", ".join(f"{c.layout} {c.status.value}" for c in bad if c is not first) + ")"
    return res


__all__ = ["FILLS", "SLOW_REPLAY", "Layout", "buffer_key", "capture_layouts", "fill_problem", "p_range", "run_capture",
           "siblings", "verify_graph"]
