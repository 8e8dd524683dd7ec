"""Summarise `kdtr bench --json` and `kdtr verify --json` reports, any mix, as plain text.

Bench: a line per (shape, implementation): time, % of the roofline, speedup over torch eager, and for a
`kdtr bench --graph` report the per-launch time of the captured graph and its ratio to the direct launch; then,
per kernel, the shapes that miss the targets (compute-bound at least 50 % of the roofline, memory-bound at
least 75 %, at least 5x torch eager, a graph replay within 1.1x the direct launch), each with the time it needs.
Verify: a line per report (kernel, sanitizer, status counts, the worst out and lse element against its tolerance,
seconds) and its failing cases. --merge writes the bench reports given as one report (and --csv / --plot beside
it), as `kdtr bench` writes a single run.

    python3 tools/summary.py REPORT.json... [--merge OUT.json [--csv OUT.csv] [--plot OUT.png]]
                             [--compute-target 0.5] [--memory-target 0.75] [--eager-target 5]
                             [--graph-target 1.1]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

EAGER = "torch-eager"
"""The baseline the speedup target is measured against."""


def fail(message: str) -> None:
    """Bad input: one line on stderr, exit code 2, before any output."""
    print(f"summary.py: {message}", file=sys.stderr)
    sys.exit(2)


def shape_tag(dims: dict) -> str:
    """'deepseek-v3 T65 P8k B1' from a bench row's dims."""
    p = dims["P"]
    return f"{dims['model']} T{dims['T']} P{p // 1024}k B{dims['B']}" if p % 1024 == 0 else \
        f"{dims['model']} T{dims['T']} P{p} B{dims['B']}"


def load(paths: list[str]) -> tuple[list[tuple[str, dict]], list[tuple[str, dict]]]:
    """(bench reports, verify reports) as (path, data); exits 2 on the first file that is neither."""
    bench, verify = [], []
    for p in paths:
        try:
            data = json.loads(Path(p).read_text())
        except (OSError, ValueError) as e:
            fail(f"cannot read {p}: {' '.join(str(e).split())[:160]}")
        if isinstance(data, dict) and "rows" in data and "peaks" in data:
            bench.append((p, data))
        elif isinstance(data, dict) and "results" in data and "kernel" in data:
            verify.append((p, data))
        else:
            fail(f"{p} is neither a `kdtr bench --json` nor a `kdtr verify --json` report")
    return bench, verify


def bench_lines(reports: list[tuple[str, dict]], targets: dict[str, float], shown: int) -> list[str]:
    """A line per shape (each implementation's time, % of the roofline, speedup over eager), then per kernel (not
    the torch baselines) the targets met and the misses, the ``shown`` nearest to their target of each kind."""
    pk = reports[0][1]["peaks"]
    rows = [r for _, d in reports for r in d["rows"]]
    impls = list(dict.fromkeys(c["impl"] for r in rows for c in r["cells"]))
    graph = [i for i in impls if any(c["impl"] == i and not (c.get("graph_status") or "skipped").startswith("skipped")
                                     for r in rows for c in r["cells"])]  # timed or failed in a graph somewhere
    from kdtr.cli.bench import mma_text

    stopped = [f"{Path(p).stem} {d['partial']['timed']} of {d['partial']['of']}" for p, d in reports if d.get("partial")]
    lines = [f"bench STOPPED, shapes timed: {', '.join(stopped)}"] if stopped else []
    lines += [f"bench on {pk.get('device', '?')}: copy {pk['copy_gbs']:.0f} GB/s, bf16 GEMM {pk['gemm_tflops']:.0f} "
             f"TFLOP/s, {mma_text(pk)}; per implementation: us, % of the roofline, speedup over {EAGER}"
             + ("; graph: us per launch replayed in a CUDA graph, its ratio to the direct launch" if graph else ""),
             f"{'shape':26s} {'bound':7s} {'floor us':>8s}" + "".join(f"  {i[:24]:>24s}" for i in impls)
             + "".join(f"  {(i[:18] + ' graph'):>24s}" for i in graph)]
    misses: dict[tuple[str, str], list[tuple[float, str]]] = {}
    counts: dict[tuple[str, str], list[int]] = {}

    def score(impl: str, what: str, ok: bool, gap: float, text: str) -> None:
        n = counts.setdefault((impl, what), [0, 0])
        n[0], n[1] = n[0] + ok, n[1] + 1
        if not ok:
            misses.setdefault((impl, what), []).append((gap, text))

    for r in rows:
        tag, floor_us = shape_tag(r["dims"]), r["roofline_ms"] * 1e3
        cells = {c["impl"]: c for c in r["cells"]}
        eager = (cells.get(EAGER) or {}).get("median_ms")
        line = f"{tag:26s} {r['bound']:7s} {floor_us:8.1f}"
        for impl in impls:
            c = cells.get(impl)
            if c is None or not c.get("median_ms"):
                line += f"  {(c['status'] if c else '-')[:24]:>24s}"
                continue
            us, roof = c["median_ms"] * 1e3, c["pct_roofline"]
            vs = f"{eager / c['median_ms']:.2f}x" if eager and impl != EAGER else ""
            line += f"  {us:10.1f} {roof:6.1%} {vs:>6s}"
            if impl.startswith("torch-"):
                continue
            want = targets[r["bound"]]
            score(impl, r["bound"], roof >= want, want - roof,
                  f"{tag}: {roof:.1%}, {us:.1f} us, needs <= {floor_us / want:.1f}")
            if eager:
                x = eager / c["median_ms"]
                score(impl, "eager", x >= targets["eager"], targets["eager"] / x,
                      f"{tag}: {x:.2f}x, {us:.1f} us, needs <= {eager * 1e3 / targets['eager']:.1f}")
        for impl in graph:
            c = cells.get(impl) or {}
            line += "  " + graph_text(c)
            if c.get("graph_ms"):
                x = c["graph_ms"] / c["median_ms"]
                score(impl, "graph", x <= targets["graph"], x - targets["graph"],
                      f"{tag}: {x:.2f}x, {c['graph_ms'] * 1e3:.1f} us, needs <= {c['median_ms'] * 1e3 * targets['graph']:.1f}")
            elif c.get("graph_status") and not c["graph_status"].startswith("skipped"):
                score(impl, "graph", False, float("inf"), f"{tag}: {c['graph_status'][:100]}")
        lines.append(line)
    for k in dict.fromkeys(k for k, _ in counts):
        kinds = [w for w in ("compute", "memory", "eager", "graph") if (k, w) in counts]
        name = {w: f"{w} >= {targets[w]:.0%}" for w in ("compute", "memory")} | {"eager": f">= {targets['eager']:g}x eager",
                                                                                "graph": f"graph <= {targets['graph']:g}x direct"}
        lines.append(f"targets, {k}: " + "; ".join(f"{name[w]}: {counts[(k, w)][0]} of {counts[(k, w)][1]}" for w in kinds))
        for w in kinds:
            missed = sorted(misses.get((k, w), []))
            for _, text in missed[:shown]:
                lines.append(f"  miss {name[w]}: {text}")
            if len(missed) > shown:
                lines.append(f"  miss {name[w]}: and {len(missed) - shown} more")
    return lines


def graph_text(c: dict) -> str:
    """A cell's graph column, 24 wide: per-launch us and the ratio to the direct launch, else why there is none."""
    if c.get("graph_ms"):
        return f"{c['graph_ms'] * 1e3:10.1f} {c['graph_ms'] / c['median_ms']:6.2f}x{'':6s}"
    status = c.get("graph_status") or "-"
    return f"{('-' if status.startswith('skipped') else status.split()[0].rstrip(':'))[:24]:>24s}"


def verify_lines(reports: list[tuple[str, dict]]) -> list[str]:
    """One line per report, then each failing case (at most 8 a report)."""
    lines = []
    for path, rep in reports:
        counts = " ".join(f"{k} {v}" for k, v in rep["counts"].items())
        worst = []
        for output in ("out", "lse"):
            ratios = [c["ratio"] for r in rep["results"] for c in r.get("checks", []) if c["output"] == output
                      and c.get("ratio") is not None]
            worst.append(f"{output} {max(ratios):.3f}" if ratios else f"{output} -")
        san = f" {rep['sanitizer']}" if rep.get("sanitizer") else ""
        lines.append(f"{Path(path).stem:34s} {rep['kernel'] + san:32s} {counts:28s} worst {', '.join(worst)} of tol, "
                     f"{rep.get('seconds') or 0:6.1f} s{'  FAILED' if rep.get('failed') else ''}"
                     + (f"  STOPPED after {rep['partial']['verified']} of {rep['partial']['of']} cases"
                        if rep.get("partial") else ""))
        failing = [r for r in rep["results"] if r["status"] not in ("PASS", "SKIPPED")]
        for r in failing[:8]:
            lines.append(f"  {r['status']:13s} {r['case'][:60]} {' '.join((r.get('message') or '').split())[:100]}")
        if len(failing) > 8:
            lines.append(f"  ... and {len(failing) - 8} more")
    return lines


def merge(reports: list[tuple[str, dict]], json_path: str, csv_path: str | None, plot_path: str | None) -> None:
    """The bench reports as one: the first report's peaks and method, every row, the implementations in order."""
    from kdtr.bench.run import csv_text, plot, rows_from_json
    from kdtr.golden.atomic import atomic_write_bytes

    first = {k: v for k, v in reports[0][1].items() if k != "partial"}
    merged = {**first, "impls": list(dict.fromkeys(i for _, d in reports for i in d.get("impls", []))),
              "rows": [r for _, d in reports for r in d["rows"]]}
    if any(d.get("partial") for _, d in reports):  # a stopped run's shapes are in; say how many of all were asked for
        merged["partial"] = {"timed": len(merged["rows"]),
                             "of": sum(d.get("partial", {}).get("of", len(d["rows"])) for _, d in reports)}
    atomic_write_bytes(json_path, (json.dumps(merged, indent=1, default=str) + "\n").encode())
    rows = rows_from_json(merged["rows"])
    if csv_path:
        atomic_write_bytes(csv_path, csv_text(rows).encode())
    if plot_path:
        plot(rows, plot_path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("reports", nargs="+", metavar="REPORT.json", help="kdtr bench / kdtr verify --json files")
    ap.add_argument("--merge", metavar="OUT.json", help="write the bench reports as one")
    ap.add_argument("--csv", metavar="OUT.csv", help="with --merge: one line per (shape, implementation)")
    ap.add_argument("--plot", metavar="OUT.png", help="with --merge: %% of roofline against prefix length")
    ap.add_argument("--compute-target", type=float, default=0.5, help="share of the roofline (default 0.5)")
    ap.add_argument("--memory-target", type=float, default=0.75, help="share of the roofline (default 0.75)")
    ap.add_argument("--misses", type=int, default=5, help="target misses shown per kind, the nearest first (default 5)")
    ap.add_argument("--eager-target", type=float, default=5.0, help="speedup over torch eager (default 5)")
    ap.add_argument("--graph-target", type=float, default=1.1,
                    help="graph replay per launch over the direct launch, at most (default 1.1)")
    args = ap.parse_args()
    if (args.csv or args.plot) and not args.merge:
        fail("--csv and --plot go with --merge OUT.json")
    bench, verify = load(args.reports)
    if args.merge and not bench:
        fail("--merge needs at least one `kdtr bench --json` report")
    for path in (args.merge, args.csv, args.plot):
        if path and not Path(path).resolve().parent.is_dir():
            fail(f"{path}: its folder does not exist")
    targets = {"compute": args.compute_target, "memory": args.memory_target, "eager": args.eager_target,
               "graph": args.graph_target}
    lines = (bench_lines(bench, targets, args.misses) if bench else []) + ([""] if bench and verify else []) + verify_lines(verify)
    print("\n".join(lines))
    if args.merge:
        merge(bench, args.merge, args.csv, args.plot)


if __name__ == "__main__":
    main()
