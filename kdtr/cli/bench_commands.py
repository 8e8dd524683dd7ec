"""What `kdtr bench` computes (plain data) and how it is shown (through kdtr.report): the GPU's
peaks, the shape grid, the timing run (one process or one per GPU), the run-to-run comparison and
the CSV / plot files. Split from kdtr.cli.commands, which holds the other commands.
"""

from __future__ import annotations

import json
from pathlib import Path

from kdtr.inputs import presets, suites


# ----------------------------------------------------------------------------- bench

def bench_peaks(remeasure: bool = False) -> dict:
    """The GPU's copy bandwidth and bf16 GEMM rate, cached per device name and driver."""
    from kdtr.kernels.launch import device_info
    from kdtr.bench.timing import measure_peaks
    from kdtr.golden.store import cache_root

    info = device_info()
    path = cache_root() / "peaks.json"
    key = f"{info['name']}|{info['driver_version']}"
    cache = json.loads(path.read_text()) if path.exists() else {}
    if remeasure or key not in cache:
        from kdtr.golden.atomic import atomic_write_bytes

        cache[key] = measure_peaks()
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, (json.dumps(cache, indent=1) + "\n").encode())
    return {**cache[key], "cached_at": str(path)}


def bench_specs(suite: str | None, preset: tuple[str, ...], shape: dict) -> list:
    from kdtr.bench.run import grid

    specs = []
    if suite:
        specs += suites.suite(suite)
    for name in preset:
        if name not in presets.BENCH_GRIDS:
            raise ValueError(f"unknown shape set {name!r}; known: {', '.join(presets.BENCH_GRIDS)}")
        g = presets.BENCH_GRIDS[name]
        specs += grid(g["models"], g["tps"], g["budgets"], g["prefixes"], g["batches"], shape["page_size"],
                      shape["kv_dtype"], shape["out_dtype"] or shape["kv_dtype"])
    if shape.get("prefix") or shape.get("budget"):
        specs += grid(presets.parse_list(shape["model"] or "deepseek-v3", str), presets.parse_list(shape["tp"] or "8", int),
                      presets.parse_list(shape["budget"] or "64", int), presets.parse_list(shape["prefix"] or "8k"),
                      presets.parse_list(shape["batch"] or "1", int), shape["page_size"], shape["kv_dtype"],
                      shape["out_dtype"] or shape["kv_dtype"])
    if not specs:
        raise ValueError("no shapes: give --set compute/memory, --suite NAME, or --prefix/--budget (with --model --tp --batch)")
    return specs


def _impls(kernel_specs, baseline_names) -> list:
    """Baselines first (the first timed one is the speedup reference), then the kernels."""
    from kdtr.bench.baselines import baseline
    from kdtr.kernels.registry import resolve_kernel

    return [baseline(b) for b in baseline_names] + [resolve_kernel(k) for k in kernel_specs]


def bench_run(specs, kernel_specs, baseline_names, peaks: dict, check: bool, devices: int = 1) -> dict:
    from kdtr.cli import report
    from kdtr.bench.run import bench_shape

    impls = _impls(kernel_specs, baseline_names)
    rows = []
    if devices > 1:
        rows = _bench_multi(specs, kernel_specs, baseline_names, peaks, check, devices)
    else:
        with report.progress(len(specs), "bench") as advance:
            for s in specs:
                rows.append(bench_shape(s, impls, peaks, check=check))
                advance(s.name)
    from dataclasses import asdict

    from kdtr.bench.timing import METHOD

    return {"peaks": {k: v for k, v in peaks.items() if k not in ("copy", "gemm")}, "rows": [asdict(r) for r in rows],
            "impls": [i.name for i in impls], **METHOD}


def _bench_multi(specs, kernel_specs, baseline_names, peaks, check, devices):
    """One process per GPU (CUDA_VISIBLE_DEVICES), shapes dealt round-robin."""
    import multiprocessing as mp

    from kdtr.bench.run import split_for_devices

    parts = split_for_devices(list(specs), devices)
    ctx = mp.get_context("spawn")
    with ctx.Pool(len(parts)) as pool:
        results = pool.starmap(_bench_worker, [(i, p, kernel_specs, baseline_names, peaks, check) for i, p in enumerate(parts)])
    order = {s.name: i for i, s in enumerate(specs)}
    return sorted((r for part in results for r in part), key=lambda r: order[r.shape])


def _bench_worker(device: int, specs, kernel_specs, baseline_names, peaks, check):
    import os

    os.environ["CUDA_VISIBLE_DEVICES"] = str(device)
    from kdtr.bench.run import bench_shape

    impls = _impls(kernel_specs, baseline_names)
    return [bench_shape(s, impls, peaks, check=check) for s in specs]


def render_bench(d: dict) -> None:
    from kdtr.cli import report

    pk = d["peaks"]
    report.note(f"peaks on {pk['device']}: copy {pk['copy_gbs']:.0f} GB/s, bf16 GEMM {pk['gemm_tflops']:.0f} TFLOP/s "
                f"({pk.get('gemm_method', '')}); roofline = max(FLOPs / GEMM peak, bytes / copy peak)")
    rows = []
    for r in d["rows"]:
        timed = [c for c in r["cells"] if c.get("median_ms")]
        best = min((c["median_ms"] for c in timed), default=None)
        for i, c in enumerate(r["cells"]):
            head = (r["shape"], f"{r['dims']['B']}x{r['dims']['T']}x{r['dims']['H']}", f"{r['dims']['P']}", r["bound"],
                    f"{r['roofline_ms'] * 1e3:.1f}") if i == 0 else ("", "", "", "", "")
            if c.get("median_ms"):
                t = f"{c['median_ms'] * 1e3:.1f} ±{c['iqr_ms'] * 1e3:.1f}"
                if c["median_ms"] == best:
                    t = f"[bold green]{t}[/]"
                cells = (t, f"{c['tflops']:.1f}", f"{c['gbs']:.0f}", f"{c['pct_roofline']:.1%}",
                         f"{c['speedup']:.1f}x" if c.get("speedup") else "-")
            else:
                cells = (f"[yellow]{report.escape(c['status'][:60])}[/]", "", "", "", "")
            rows.append(head + (c["impl"],) + cells)
    report.table("kdtr bench", ["shape", "BxTxH", "P", "bound", "floor us", "impl", "time us", "TFLOP/s", "GB/s",
                                "% roofline", "vs torch"], rows,
                 right=("floor us", "time us", "TFLOP/s", "GB/s", "% roofline", "vs torch"))


def bench_compare(old_path: str, new_path: str) -> dict:
    from kdtr.bench.run import compare_runs

    def load(p):
        try:
            return json.loads(Path(p).read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"{p}: not a kdtr bench JSON ({e})") from None

    return {"old": old_path, "new": new_path, "changes": compare_runs(load(old_path), load(new_path))}


def render_bench_compare(d: dict) -> None:
    from kdtr.cli import report

    rows = [(c["shape"], c["impl"], f"{c['old_ms'] * 1e3:.1f}", f"{c['new_ms'] * 1e3:.1f}", f"{c['ratio']:.2f}x",
             report.status_text(c["change"]))
            for c in d["changes"]]
    report.table(f"bench compare {d['old']} -> {d['new']}", ["shape", "impl", "old us", "new us", "speedup", "change"],
                 rows, right=("old us", "new us", "speedup"))


def _rows(data: dict):
    from kdtr.bench.run import Cell, Row

    return [Row(**{**r, "cells": [Cell(**c) for c in r["cells"]]}) for r in data["rows"]]


def write_csv(path: str, data: dict) -> None:
    import csv
    import io

    from kdtr.bench.run import to_csv_rows
    from kdtr.golden.atomic import atomic_write_bytes

    flat = to_csv_rows(_rows(data))
    buf = io.StringIO()
    if flat:
        w = csv.DictWriter(buf, fieldnames=list(flat[0]))
        w.writeheader()
        w.writerows(flat)
    atomic_write_bytes(path, buf.getvalue().encode())


def write_plot(path: str, data: dict) -> None:
    from kdtr.bench.run import plot

    plot(_rows(data), path)
