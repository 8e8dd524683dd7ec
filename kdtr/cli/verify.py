"""`kdtr verify`: a kernel against golden bundles, one table row per case.

The default table fits 80 columns: a short case label, the status and the figure that decides
it, the largest share of a tolerance the case used (above 1 fails); the messages of the cases
that did not pass follow the table. --wide shows every figure and full case names; --json all.
--graph (kdtr/check/graph.py): the caption counts the captures that passed (--wide: per case), a case's
figure is its first failing capture's where the direct run passed, and the warnings (a replay much
slower than the direct launch) follow the table.
"""

from __future__ import annotations

import math
import re
import sys

import click

from kdtr.cli.options import (EXIT_FAIL, EXIT_INTERRUPTED, EXIT_OK, STDOUT, at_least, check_output, checkpoint_to,
                              emit, json_option, stop_on_sigterm)
from kdtr.errors import InputError

SHARE_KINDS = {"elem": "|err| / (atol + rtol |ref|)", "norm": "relative norm / its bound", "cos": "(1 - cos) / (1 - min cos)",
               "bias": "|mean rounding error in bf16 ulps| / its bound"}
"""The bounds a case's figure may come from (kdtr.check.compare), as the caption explains them."""
JUDGED = ("PASS", "FAIL_NUMERIC")
"""Statuses whose outputs were compared with the reference (the others carry no figure)."""


def verify_run(kernel_spec: str, sources: list[str], repeat: int = 1, overrides: dict | None = None,
               json_to: str | None = None, jobs: int = 1, *, isolate: bool = True, timeout: float | None = None,
               sanitize: str | None = None, force: bool = False, wide: bool = False, graph: bool = False):
    """Check everything the user gave, run the verification, show it (or its JSON); the VerifyReport."""
    from kdtr.check.suite import preflight, run_verify
    from kdtr.cli import report
    from kdtr.golden.store import find_bundles
    from kdtr.golden.tolerances import check_overrides
    from kdtr.kernels.registry import resolve_kernel

    check_overrides(overrides)
    check_output(json_to, "--json", ".json")
    kernel = resolve_kernel(kernel_spec)
    preflight(kernel)
    if sanitize:  # fail on a missing compute-sanitizer before generating or loading anything
        from kdtr.check.isolate import sanitizer_command

        sanitizer_command(sanitize)
    paths = find_bundles(sources, jobs=jobs, force=force)
    save = checkpoint_to(json_to)
    with report.progress(len(paths), f"verify {kernel.name}", show=json_to != STDOUT) as advance, stop_on_sigterm():
        rep = run_verify(kernel, paths, repeat=repeat, overrides=overrides, on_case=lambda r: advance(r.case),
                         isolate=isolate, timeout=timeout, sanitize=sanitize, spec=kernel_spec, graph=graph,
                         checkpoint=(lambda part: save(part.to_json())) if save else None)
    emit(rep.to_json(), json_to, lambda d: render_verify(d, wide))
    return rep


def share(check: dict) -> tuple[float, str] | None:
    """(largest share of a tolerance one output used, which bound) for a judged output; > 1 fails."""
    if check["status"] not in JUDGED:
        return None
    tol = check["tol"]
    parts = {"elem": check["ratio"], "norm": _over(check["rel_norm"], tol["rel_norm"]),
             "cos": _over(max(0.0, 1.0 - check["cos"]), 1.0 - tol["min_cos"])}
    biases = [abs(b) for b in (check.get("ulp_bias"), check.get("ulp_drift")) if b is not None]
    if biases:
        from kdtr.golden.tolerances import BIAS_MAX

        parts["bias"] = max(biases) / BIAS_MAX
    parts = {k: 0.0 if math.isnan(v) else v for k, v in parts.items()}  # 0/0: exact where the bound is 0
    kind = max(parts, key=parts.get)
    return parts[kind], kind


def _over(value: float, bound: float) -> float:
    return value / bound if bound > 0 else (0.0 if value <= 0 else math.inf)


def case_share(result: dict) -> tuple[float, str] | None:
    """The figure that decides a case: the largest share over its outputs, named "out elem" etc. (under
    --graph, those of the first failing capture where the direct run passed)."""
    checks = _failing_checks(result) or result["checks"]
    shares = [(s[0], f"{c['output']} {s[1]}") for c in checks if (s := share(c)) is not None]
    return max(shares) if shares else None


def short_label(case: str) -> str:
    """A case name cut for an 80-column table: a prefix list of 3 or more as first..last, no seed 0."""
    label = re.sub(r"-s0$", "", case)
    return re.sub(r"-p([0-9k]+)(?:\.[0-9k]+)+\.([0-9k]+)-", r"-p\1..\2-", label)


def _figure(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.2g}" if x < 0.1 else f"{x:.2f}" if x < 100 else f"{x:.3g}"


def _failing_checks(r: dict) -> list[dict]:
    """The checks a case's message is about: the direct run's where it failed, else those of the first
    failing capture (verify --graph)."""
    if any(c["status"] != "PASS" for c in r["checks"]):
        return r["checks"]
    bad = [c for c in r.get("captures") or [] if c["status"] != "PASS" and c.get("checks")]
    return bad[0]["checks"] if bad else []


def _detail(r: dict) -> str:
    """The message of a case that did not pass, the worst element, then a line per distinct
    localisation of its failing outputs (which requests, heads, nodes, depths)."""
    checks = _failing_checks(r)
    out = next((c for c in checks if c["output"] == "out"), None)
    text = r["message"]
    if out and out["status"] != "PASS" and out.get("worst"):
        text += f" (worst element at {tuple(out['worst'])})"
    wheres: dict[str, list[str]] = {}
    for c in checks:
        if c["status"] != "PASS" and c.get("where"):
            wheres.setdefault(c["where"], []).append(c["output"])
    for where, outputs in wheres.items():
        text += f"\n{' and '.join(outputs)} failing in {where}"
    return text


def render_verify(d: dict, wide: bool = False) -> None:
    from kdtr.cli import report

    graph = bool(d.get("graph"))
    how = (" --graph" if graph else "") + (f" under compute-sanitizer {d['sanitizer']}" if d.get("sanitizer") else "")
    title = f"kdtr verify -k {d['kernel']}{how}\non {d['device']}"  # two lines: a GPU's line is long
    counts = ", ".join(f"{k} {v}" for k, v in sorted(d["counts"].items()))
    notes = [f"{counts} in {d['seconds']:.1f} s"]
    if not d.get("lse_checked", True):
        notes.append("lse not checked (the kernel sets kdtr_writes_lse = False)")
    if graph:
        caps = [c for r in d["results"] for c in r.get("captures") or []]
        notes.append(f"--graph: {sum(c['status'] == 'PASS' for c in caps)} of {len(caps)} captures passed (each case "
                     "captured at P = 0, 1, 1024 with a chain tree where its buffers hold them, and on the previous "
                     "bundle of the same buffers, then replayed on it)")
    notes.append("err/tol: the share of a tolerance used, above 1 fails"
                 + (" (" + "; ".join(f"{k}: {v}" for k, v in SHARE_KINDS.items()) + ")" if wide else
                    ", from the element-wise bound (elem), the relative norm (norm), the cosine (cos) or the rounding "
                    "bias (bias)"))
    label = (lambda n: n) if wide else short_label
    if wide:
        _wide_table(report, d, title, "; ".join(notes))
    else:
        rows = []
        for r in d["results"]:
            s = case_share(r)
            rows.append((report.escape(label(r["case"])), report.status_text(r["status"]),
                         _figure(s[0]) if s else "-", s[1] if s else ""))
        report.table(title, ["case", "status", "err/tol", "from"], rows, right=("err/tol",),
                     no_wrap=("status", "err/tol", "from"), caption="; ".join(notes))
    report.details("skipped or failed, and why", [(label(r["case"]), _detail(r)) for r in d["results"] if r["status"] != "PASS"])
    report.details("warnings", [(label(r["case"]), w) for r in d["results"] for w in r.get("warnings") or []])
    if d.get("partial"):
        report.notice("interrupted:", f"{d['partial']['verified']} of {d['partial']['of']} cases verified; the others "
                      "did not run, so this run is not a pass")


def captured(r: dict) -> str:
    """verify --graph's cell: the captures that passed of those made ("3/3"), "-" where none was made."""
    caps = r.get("captures") or []
    return f"{sum(c['status'] == 'PASS' for c in caps)}/{len(caps)}" if caps else "-"


def _wide_table(report, d: dict, title: str, caption: str) -> None:
    rows = []
    for r in d["results"]:
        s = r["shape"]
        by = {c["output"]: c for c in r["checks"]}
        out, lse = by.get("out"), by.get("lse")
        parts = {}
        if out and out["status"] in JUDGED:
            tol = out["tol"]
            parts = {"elem": out["ratio"], "norm": _over(out["rel_norm"], tol["rel_norm"]),
                     "cos": _over(max(0.0, 1 - out["cos"]), 1 - tol["min_cos"]), "max": out["max_abs"],
                     "bias": out.get("ulp_bias")}
        ls = share(lse) if lse else None
        p = f"{s.get('P_min')}" if s.get("P_min") == s.get("P_max") else f"{s.get('P_min')}..{s.get('P_max')}"
        graph = [captured(r), report.fmt(min((c["ms"] for c in r["captures"] if c.get("ms") is not None), default=None))
                 ] if d.get("graph") else []
        rows.append((report.escape(r["case"]), f"{s.get('B')}x{s.get('T')}x{s.get('H')}", p, s.get("tree", ""),
                     f"{s.get('kv')}/{s.get('out')}", *(report.fmt(parts.get(k)) for k in ("elem", "norm", "cos", "max", "bias")),
                     _figure(ls[0]) if ls else "-", report.fmt(r.get("ms")), *graph, report.status_text(r["status"])))
    cols = ["case", "BxTxH", "P", "tree", "kv/out", "out elem", "out norm", "out cos", "out max|err|", "out bias ulp",
            "lse err/tol",
            "ms", *(["graph", "replay ms"] if d.get("graph") else []), "status"]
    report.table(title, cols, rows, right=cols[5:-1], caption=caption, wide=True)


@click.command()
@click.argument("bundles", nargs=-1)
@click.option("-k", "--kernel", "kernel_spec", required=True,
              help="Built-in name (kdtr list), path/file.cu:symbol, package.module:fn or path/file.py:fn.")
@click.option("--repeat", type=int, default=1, show_default=True, help="Runs per case; all must be bit-identical.")
@json_option("The full report")
@click.option("--wide", is_flag=True, help="Every figure per case and full case names (wider than 80 columns).")
@click.option("--atol", type=float, default=None, help="Override atol of out (a finite number >= 0).")
@click.option("--rtol", type=float, default=None, help="Override rtol of out (a finite number >= 0).")
@click.option("--rel-norm", type=float, default=None, help="Override the relative-norm bound of out (finite, >= 0).")
@click.option("-j", "--jobs", type=int, default=1, help="Workers when a suite must be generated first.")
@click.option("--isolate/--no-isolate", default=True, show_default=True,
              help="Run each case in a child process, so a kernel that crashes or hangs fails only its case "
                   "(RUNTIME_ERROR / TIMEOUT). --no-isolate: in this process (faster; a crash ends the run).")
@click.option("--timeout", type=float, default=None,
              help="Seconds per case before its child is killed (TIMEOUT). Default: 60 + the case's visible "
                   "FLOPs at 10 GFLOP/s (1 GFLOP/s for CPU kernels) per run + 1 s per 100 MB of bundle; "
                   "under --sanitize 300 + 100x that.")
@click.option("--sanitize", type=click.Choice(["memcheck", "racecheck", "initcheck", "synccheck"]), default=None,
              help="Run each case's child (one run) under compute-sanitizer with this tool; findings are SANITIZER.")
@click.option("--force", is_flag=True, help="Generate a missing suite even where generation's checks would refuse.")
@click.option("--graph", is_flag=True,
              help="Also capture each case's launch as a server's CUDA graph (at prefix lengths 0, 1, 1024 and on the "
                   "previous bundle of the same buffers), write the case into the same buffers and replay: every check "
                   "applies to the replay, a second replay must match bit for bit, a failed capture is CAPTURE_ERROR.")
def verify(bundles, kernel_spec, repeat, json_to, wide, atol, rtol, rel_norm, jobs, isolate, timeout, sanitize, force,
           graph):
    """Verify a kernel against golden bundles (files, directories, globs or suite names; default smoke)."""
    at_least("--repeat", repeat, 1)
    at_least("-j/--jobs", jobs, 1)
    if timeout is not None and not (timeout > 0 and math.isfinite(timeout)):
        raise InputError(f"--timeout must be a positive number of seconds, got {timeout}")
    if not isolate and (timeout is not None or sanitize):
        raise InputError("--timeout and --sanitize run each case in a child process: drop --no-isolate")
    overrides = {"out": {"atol": atol, "rtol": rtol, "rel_norm": rel_norm}}
    rep = verify_run(kernel_spec, list(bundles) or ["smoke"], repeat, overrides, json_to, jobs,
                     isolate=isolate, timeout=timeout, sanitize=sanitize, force=force, wide=wide, graph=graph)
    sys.exit(EXIT_INTERRUPTED if rep.partial else EXIT_FAIL if rep.failed else EXIT_OK)
