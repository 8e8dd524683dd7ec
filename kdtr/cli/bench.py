"""`kdtr bench`: kernels timed against the GPU's roofline and torch baselines, and `kdtr bench
compare` of two saved runs. Every option is checked before the GPU is asked for anything, so a
typo is reported on a machine without one too."""

from __future__ import annotations

import json
import sys
from contextlib import closing
from pathlib import Path

import click

from kdtr.cli.options import (EXIT_INTERRUPTED, STDOUT, at_least, check_output, checkpoint_to, emit, json_option,
                              option_list, stop_on_sigterm, write_file)
from kdtr.errors import InputError


def bench_peaks(remeasure: bool = False) -> dict:
    """The GPU's copy bandwidth, bf16 GEMM rate and mma.sync ceiling, cached per device name and driver; an
    entry without one of them (written before the mma.sync ceiling was measured, or where it could not be) is
    measured again, all of it, so the ceilings always come from one run."""
    from kdtr.bench.timing import measure_peaks
    from kdtr.golden.atomic import atomic_write_bytes
    from kdtr.golden.store import cache_root
    from kdtr.kernels.launch import device_info

    info = device_info()
    path = cache_root() / "peaks.json"
    key = f"{info['name']}|{info['driver_version']}"
    try:
        cache = json.loads(path.read_text()) if path.exists() else {}
    except ValueError:
        cache = {}  # a damaged cache is measured again
    if remeasure or stale_peaks(cache.get(key)):
        cache[key] = measure_peaks()
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, (json.dumps(cache, indent=1) + "\n").encode())
    return {**cache[key], "cached_at": str(path)}


def stale_peaks(entry) -> bool:
    """True where a cached peaks entry must be measured again: none, not a dict, or a ceiling missing or unmeasured."""
    from kdtr.bench.timing import PEAK_KEYS

    return not isinstance(entry, dict) or any(not isinstance(entry.get(k), (int, float)) for k in PEAK_KEYS)


def bench_specs(suite: str | None, preset: tuple[str, ...], shape: dict) -> list:
    from kdtr.bench.run import grid
    from kdtr.inputs import presets, suites

    specs = []
    if suite:
        specs += suites.suite(suite)
    for name in preset:
        if name not in presets.BENCH_GRIDS:
            raise InputError(f"--set {name}: unknown shape set; known: {', '.join(presets.BENCH_GRIDS)}")
        g = presets.BENCH_GRIDS[name]
        specs += grid(g["models"], g["tps"], g["budgets"], g["prefixes"], g["batches"], shape["page_size"],
                      shape["kv_dtype"], shape["out_dtype"] or shape["kv_dtype"])
    if shape.get("prefix") or shape.get("budget"):
        specs += grid(option_list("--model", shape["model"] or "deepseek-v3", str),
                      option_list("--tp", shape["tp"] or "8", int), option_list("--budget", shape["budget"] or "64", int),
                      option_list("--prefix", shape["prefix"] or "8k"), option_list("--batch", shape["batch"] or "1", int),
                      shape["page_size"], shape["kv_dtype"], shape["out_dtype"] or shape["kv_dtype"])
    if not specs:
        raise InputError("no shapes: give --set compute/memory, --suite NAME, or --prefix/--budget (with --model --tp --batch)")
    return specs


def baseline_names(text: str) -> list[str]:
    """The --baselines list, each name checked (InputError naming the known ones)."""
    from kdtr.bench.baselines import baseline

    names = [] if text.strip() in ("", "none") else [b.strip() for b in text.split(",") if b.strip()]
    for n in names:
        baseline(n)  # ValueError on an unknown name; builds nothing on the GPU
    return names


def _impls(kernel_specs, names) -> list:
    """Baselines first (the first timed one is the speedup reference), then the kernels."""
    from kdtr.bench.baselines import baseline
    from kdtr.kernels.registry import resolve_kernel

    return [baseline(b) for b in names] + [resolve_kernel(k) for k in kernel_specs]


def bench_run(specs, kernel_specs, names, peaks: dict, check: bool, devices: int = 1, progress: bool = True,
              graph: bool = False, checkpoint=None) -> dict:
    """Every shape timed (``graph``: also captured in a CUDA graph, kdtr/bench/graph.py); the report as JSON data.
    A sweep can take an hour, so nothing timed is lost: ``checkpoint(data)`` gets the report so far after every
    shape (the CLI writes --json there), and Ctrl-C or SIGTERM ends the run with the shapes done, the report then
    marked ``partial``."""
    from dataclasses import asdict

    from kdtr.bench.timing import METHOD
    from kdtr.cli import report

    impls = _impls(kernel_specs, names)
    order = {s.name: i for i, s in enumerate(specs)}
    rows = []

    def data() -> dict:
        out = {"peaks": {k: v for k, v in peaks.items() if not isinstance(v, dict)},
               "rows": [asdict(r) for r in sorted(rows, key=lambda r: order[r.shape])], "impls": [i.name for i in impls], **METHOD}
        if len(rows) < len(specs):
            out["partial"] = {"timed": len(rows), "of": len(specs)}
        if graph:
            from kdtr.bench.graph import METHOD as GRAPH

            out["graph"] = {**GRAPH, "checked": check}
        return out

    timed = _timed_rows(specs, impls, kernel_specs, names, peaks, check, devices, graph)
    with report.progress(len(specs), "bench", show=progress) as advance, stop_on_sigterm(), closing(timed):
        try:
            for row in timed:
                rows.append(row)
                advance(row.shape)
                if checkpoint and len(rows) < len(specs):
                    checkpoint(data())
        except KeyboardInterrupt:
            pass
    return data()


def _timed_rows(specs, impls, kernel_specs, names, peaks, check, devices, graph):
    """Each shape's Row as it finishes: in this process on ``impls``, or with devices > 1 one process per GPU
    (CUDA_VISIBLE_DEVICES), each making its own implementations from the specs and taking the next shape as it
    frees up."""
    from kdtr.bench.run import bench_shape

    if devices <= 1 or len(specs) <= 1:
        for s in specs:
            yield bench_shape(s, impls, peaks, check=check, graph=graph)
        return
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    gpus = ctx.Queue()
    for i in range(min(devices, len(specs))):
        gpus.put(i)
    with ctx.Pool(min(devices, len(specs)), _bench_worker_init, (gpus, kernel_specs, names)) as pool:
        yield from pool.imap_unordered(_bench_worker, [(s, peaks, check, graph) for s in specs])


_WORKER: dict = {}
"""A bench worker process's implementations, made once by _bench_worker_init."""


def _bench_worker_init(gpus, kernel_specs, names) -> None:
    import os
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: it ends the pool
    os.environ["CUDA_VISIBLE_DEVICES"] = str(gpus.get())  # this worker's GPU, before cupy starts
    _WORKER["impls"] = _impls(kernel_specs, names)


def _bench_worker(job):
    from kdtr.bench.run import bench_shape

    spec, peaks, check, graph = job
    return bench_shape(spec, _WORKER["impls"], peaks, check=check, graph=graph)


def render_peaks(pk: dict) -> None:
    from kdtr.cli import report

    report.kv_table("GPU peaks", [(k, v) for k, v in pk.items() if not isinstance(v, (dict, list))])
    report.note(f"ceilings: copy {pk['copy_gbs']:.0f} GB/s, bf16 GEMM {pk['gemm_tflops']:.0f} TFLOP/s, {mma_text(pk)}")


def mma_text(pk: dict) -> str:
    """The mma.sync ceiling of a peaks dict in words: its rate and share of the GEMM peak, why it is missing where
    it was not measured, or that the peaks predate it."""
    if pk.get("mma_tflops"):
        return f"mma.sync ceiling {pk['mma_tflops']:.0f} TFLOP/s ({pk['mma_tflops'] / pk['gemm_tflops']:.0%} of the GEMM)"
    if "mma_tflops" in pk:
        return f"mma.sync ceiling {pk.get('mma_method') or 'not measured'}"
    return "no mma.sync ceiling (peaks from before it was measured)"


def pct_text(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


MMA_COLUMN = "% mma.sync"
"""The bench table's column of a compute-bound timing's TFLOP/s over the mma.sync ceiling (pct_mma_ceiling), present
where the run's peaks have the ceiling ("-" on memory-bound shapes)."""
GRAPH_COLUMNS = ("graph us", "graph/direct", "L")
"""The bench table's --graph columns, beside the direct time: the per-launch time of the replayed graph, its
ratio to the direct launch's, and the layers (launches) in the graph."""


def render_bench(d: dict) -> None:
    from kdtr.cli import report

    pk = d["peaks"]
    report.note(f"peaks on {pk['device']}: copy {pk['copy_gbs']:.0f} GB/s, bf16 GEMM {pk['gemm_tflops']:.0f} TFLOP/s "
                f"({pk.get('gemm_method', '')}), {mma_text(pk)}; roofline = max(FLOPs / GEMM peak, bytes / copy peak)")
    graph = any(c.get("graph_status") is not None for r in d["rows"] for c in r["cells"])
    mma = bool(pk.get("mma_tflops")) or any(c.get("pct_mma_ceiling") is not None for r in d["rows"] for c in r["cells"])
    rows, failed = [], []
    for r in d["rows"]:
        timed = [c for c in r["cells"] if c.get("median_ms")]
        fastest = min((c["median_ms"] for c in timed), default=None)
        for i, c in enumerate(r["cells"]):
            head = (report.escape(r["shape"]), f"{r['dims']['B']}x{r['dims']['T']}x{r['dims']['H']}", f"{r['dims']['P']}",
                    r["bound"], f"{r['roofline_ms'] * 1e3:.1f}") if i == 0 else ("", "", "", "", "")
            if c.get("median_ms"):
                t = f"{c['median_ms'] * 1e3:.1f} ±{c['iqr_ms'] * 1e3:.1f}"
                first = (report.best(t) if c["median_ms"] == fastest else t,)
                cells = (f"{c['tflops']:.1f}", f"{c['gbs']:.0f}", f"{c['pct_roofline']:.1%}",
                         *((pct_text(c.get("pct_mma_ceiling")),) if mma else ()),
                         f"{c['speedup']:.1f}x" if c.get("speedup") else "-")
            else:
                first, cells = (report.warn(c["status"][:60]),), ("",) * (5 if mma else 4)
            extra = graph_cells(c, report) if graph else ()
            if graph and c.get("graph_status") and not c["graph_status"].startswith(("ok", "skipped")):
                failed.append((f"{r['shape']} {c['impl']}", c["graph_status"]))
            rows.append(head + (report.escape(c["impl"]),) + first + extra + cells)
    time_cols = ("time us", *(GRAPH_COLUMNS if graph else ()))
    pct_cols = ("% roofline", *((MMA_COLUMN,) if mma else ()))
    report.table("kdtr bench", ["shape", "BxTxH", "P", "bound", "floor us", "impl", *time_cols, "TFLOP/s", "GB/s",
                                *pct_cols, "vs torch"], rows,
                 right=("floor us", *time_cols, "TFLOP/s", "GB/s", *pct_cols, "vs torch"))
    if d.get("partial"):
        report.notice("interrupted:", f"{d['partial']['timed']} of {d['partial']['of']} shapes timed; they are above "
                      "(and in --json, written after every shape)")
    if graph:
        how = d.get("graph") or {}
        report.note(f"graph us: per launch of L launches (L layers, each on its own cache) captured in one CUDA graph at "
                    f"prefix length {how.get('capture_prefix_len', 1)} and replayed at the real lengths; "
                    + ("every layer's output checked before timing" if how.get("checked", True) else "not checked (--no-check)"))
        report.details("graph failures", failed)


def graph_cells(c: dict, report) -> tuple[str, str, str]:
    """A cell's --graph columns: per-launch us, graph/direct and L; "-" where it was not timed (the JSON
    says why), the status's first word where the replay failed (its full text below the table)."""
    if c.get("graph_ms"):
        return (f"{c['graph_ms'] * 1e3:.1f}", f"{c['graph_vs_direct']:.2f}x" if c.get("graph_vs_direct") else "-",
                str(c.get("graph_layers") or "-"))
    status = c.get("graph_status") or ""
    if not status or status.startswith("skipped"):
        return ("-", "", "")
    return (report.warn(status.split()[0].rstrip(":")), "", str(c.get("graph_layers") or ""))


def load_bench_report(path: str) -> dict:
    """A saved `kdtr bench --json` run, its structure checked (InputError naming what it is instead)."""
    try:
        d = json.loads(Path(path).read_text())
    except OSError as e:
        raise InputError(f"{path}: cannot read it ({e.strerror or e})") from None
    except ValueError as e:
        raise InputError(f"{path}: not JSON ({e}); give two `kdtr bench --json FILE.json` runs") from None

    def cell_ok(c) -> bool:
        timed = ("median_ms", "iqr_ms")
        return isinstance(c, dict) and isinstance(c.get("impl"), str) and (
            not c.get("median_ms") or all(isinstance(c.get(k), (int, float)) for k in timed)) and (
            not c.get("graph_ms") or isinstance(c["graph_ms"], (int, float)))

    rows = d.get("rows") if isinstance(d, dict) else None
    if not isinstance(rows, list) or not all(isinstance(r, dict) and isinstance(r.get("shape"), str)
                                             and isinstance(r.get("cells"), list) and all(map(cell_ok, r["cells"]))
                                             for r in rows):
        what = "a kdtr verify report" if isinstance(d, dict) and "results" in d and "counts" in d else "some other JSON"
        raise InputError(f"{path}: {what}, not a kdtr bench report; write one with `kdtr bench --json FILE.json`")
    return d


def bench_compare(old_path: str, new_path: str) -> dict:
    from kdtr.bench.run import compare_runs

    old, new = load_bench_report(old_path), load_bench_report(new_path)
    stopped = {p: d["partial"] for p, d in ((old_path, old), (new_path, new)) if d.get("partial")}
    return {"old": old_path, "new": new_path, "changes": compare_runs(old, new), **({"stopped": stopped} if stopped else {})}


def render_bench_compare(d: dict) -> None:
    from kdtr.cli import report

    graph = any(c.get("graph_change") for c in d["changes"])
    rows = []
    for c in d["changes"]:
        row = (report.escape(c["shape"]), report.escape(c["impl"]), f"{c['old_ms'] * 1e3:.1f}", f"{c['new_ms'] * 1e3:.1f}",
               f"{c['ratio']:.2f}x", report.status_text(c["change"]))
        if graph:
            row += ((f"{c['old_graph_ms'] * 1e3:.1f}", f"{c['new_graph_ms'] * 1e3:.1f}", f"{c['graph_ratio']:.2f}x",
                     report.status_text(c["graph_change"])) if c.get("graph_change") else ("-", "-", "", ""))
        rows.append(row)
    cols = ["shape", "impl", "old us", "new us", "speedup", "change"]
    gcols = ["old graph us", "new graph us", "graph speedup", "graph change"] if graph else []
    report.table(f"bench compare {d['old']} -> {d['new']}", cols + gcols, rows,
                 right=("old us", "new us", "speedup", "old graph us", "new graph us", "graph speedup"),
                 no_wrap=("change", "graph change"))
    for path, part in (d.get("stopped") or {}).items():
        report.notice("stopped run:", f"{path} timed {part['timed']} of {part['of']} shapes; only pairs timed in both "
                      "runs are compared")
    if not d["changes"]:
        report.note("no (shape, impl) pair was timed in both runs")


def write_csv(path: str, data: dict) -> None:
    """One line per (shape, impl) of a bench run."""
    from kdtr.bench.run import csv_text, rows_from_json

    write_file(path, csv_text(rows_from_json(data["rows"])), "--csv")


def write_plot(path: str, data: dict) -> None:
    """% of roofline vs prefix per budget (matplotlib)."""
    from kdtr.bench.run import plot, rows_from_json

    plot(rows_from_json(data["rows"]), path)


def check_bench_options(devices: int, shape: dict, csv_file, plot_file, json_to) -> None:
    import importlib.util

    check_output(json_to, "--json", ".json")
    check_output(csv_file, "--csv", ".csv")
    check_output(plot_file, "--plot", ".png")
    at_least("--devices", devices, 1)
    at_least("--page-size", shape["page_size"], 1)
    if plot_file and importlib.util.find_spec("matplotlib") is None:
        raise InputError("--plot needs matplotlib: pip install 'kdtr[plot]'")


@click.group(invoke_without_command=True)
@click.option("-k", "--kernel", "kernels", multiple=True, default=("flash", "flash-sm90"), show_default=True,
              help="Kernel(s) to time: built-in name, file.cu:symbol, module:fn or file.py:fn (repeatable); "
                   "flash-sm90 is skipped off sm_90.")
@click.option("--baselines", default="eager,sdpa,flex", show_default=True,
              help="Baselines side by side (comma list of eager, sdpa, flex, sglang-triton: SGLang's own kernel, "
                   "where sglang is installed, flashmla-mtp: FlashMLA's causal MTP decode, where flash_mla loads, "
                   "on sm_90 at page size 64; 'none' for none).")
@click.option("--set", "sets", multiple=True, help="Named shape set(s): compute, memory.")
@click.option("--suite", default=None, help="Time the cases of a suite (smoke, ci, long).")
@click.option("--model", default=None, help="Grid: models, e.g. deepseek-v3,kimi-k2.")
@click.option("--tp", default=None, help="Grid: tensor-parallel degrees, e.g. 8.")
@click.option("--budget", default=None, help="Grid: budgets, e.g. 64,256 (0 = decode).")
@click.option("--prefix", default=None, help="Grid: prefix lengths, e.g. 8k,32k,128k.")
@click.option("--batch", default=None, help="Grid: batch sizes, e.g. 1,8.")
@click.option("--page-size", type=int, default=64, show_default=True)
@click.option("--kv-dtype", default="bf16", show_default=True)
@click.option("--out-dtype", default=None)
@click.option("--peaks", "peaks_only", is_flag=True, help="Measure (or show the cached) GPU peaks and stop.")
@click.option("--remeasure", is_flag=True, help="Re-measure the peaks instead of using the cache.")
@click.option("--no-check", is_flag=True, help="Skip the correctness gate before timing.")
@click.option("--devices", type=int, default=1, show_default=True, help="Spread shapes over this many local GPUs.")
@click.option("--graph", is_flag=True,
              help="Also time each kernel as a server runs it: one launch per layer on L layers' caches (L x KV "
                   ">= 4x the L2), captured in one CUDA graph at prefix length 1 and replayed at the real lengths "
                   "(the first replay checked); the per-launch time goes beside the direct one.")
@json_option("The full results")
@click.option("--csv", "csv_file", type=click.Path(dir_okay=False), help="Write one line per (shape, impl) to FILE.csv.")
@click.option("--plot", "plot_file", type=click.Path(dir_okay=False), help="FILE.png: % of roofline vs prefix per budget.")
@click.pass_context
def bench(ctx, kernels, baselines, sets, suite, peaks_only, remeasure, no_check, devices, graph, json_to, csv_file,
          plot_file, **shape):
    """Time kernels against the GPU's roofline and torch baselines (`kdtr bench compare A B` to diff runs)."""
    if ctx.invoked_subcommand:
        return
    from kdtr.kernels.launch import gpu_available, gpu_unavailable_reason
    from kdtr.kernels.registry import resolve_kernel

    check_bench_options(devices, shape, csv_file, plot_file, json_to)
    names = baseline_names(baselines)
    specs = [] if peaks_only else bench_specs(suite, sets, shape)
    for k in kernels:
        resolve_kernel(k)  # a misspelt kernel is reported before the GPU is touched
    if not gpu_available():
        raise InputError(f"kdtr bench times kernels on a CUDA GPU: none here ({gpu_unavailable_reason()}); "
                         "the options are fine")
    peaks = bench_peaks(remeasure)
    if peaks_only:
        emit(peaks, json_to, render_peaks)
        return
    data = bench_run(specs, list(kernels), names, peaks, not no_check, devices, progress=json_to != STDOUT, graph=graph,
                     checkpoint=checkpoint_to(json_to))
    emit(data, json_to, render_bench)
    if csv_file:
        write_csv(csv_file, data)
    if plot_file:
        write_plot(plot_file, data)
    if data.get("partial"):
        sys.exit(EXIT_INTERRUPTED)


@bench.command("compare")
@click.argument("old", type=str)
@click.argument("new", type=str)
@json_option("The changes")
def bench_compare_cmd(old, new, json_to):
    """Per-shape change between two `kdtr bench --json` runs, flagged beyond the measured noise."""
    check_output(json_to, "--json", ".json")
    emit(bench_compare(old, new), json_to, render_bench_compare)
