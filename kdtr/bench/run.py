"""`kdtr bench`: time kernels over serving shapes against the GPU's own roofline.

Per shape: build the layout (paged cache, DDTree trees), draw fresh random values on the GPU,
check every implementation once against a reference (exact float64 for small shapes, the
naive fp32 kernel for large ones; for a peer whose mask is another tree's, such as FlashMLA's causal one, the
same inputs under that tree; a failing implementation is not timed), then time each with
CUDA events, warm-up, a flushed L2 and a median over repetitions (kdtr.timing.time_launcher).
With ``graph``, each kernel is then also timed as a server runs it: L launches on L layers captured in
one CUDA graph and replayed (kdtr/bench/graph.py), the per-launch time in the cell's graph fields.

FLOPs count visible (q, key) pairs only, 2 * H * sum_t (P_b + depth_t + 1) * (576 + 512);
bytes are the minimum: the KV each request owns read once, q read, out and lse written. On compute-bound
shapes each timing is also held against the mma.sync ceiling (the peaks' mma_tflops, kdtr/bench/timing.py
measure_mma_peak): the rate of the instruction the portable kernel issues, below the GEMM peak on Hopper.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

from kdtr.inputs import presets
from kdtr.inputs.cases import CaseSpec, build_problem
from kdtr.inputs.presets import DK, DV
from kdtr.inputs.problem import visible_flops

EXACT_REF_LIMIT = 1 << 28
"""rows x keys above which the gate's reference is the naive kernel, not the CPU float64 one."""


def kv_bytes(problem) -> int:
    """The KV one launch reads: each request's P_b + T latent rows, once."""
    return int((problem.prefix_lens.astype(np.int64) + problem.T).sum()) * DK * presets.dtype_of(problem.kv_dtype).itemsize


def min_bytes(problem, out_dtype: str) -> int:
    """KV read once per request + q read + out and lse written."""
    es = presets.dtype_of(problem.kv_dtype).itemsize
    rows = problem.B * problem.T * problem.H
    return kv_bytes(problem) + rows * DK * es + rows * DV * presets.dtype_of(out_dtype).itemsize + rows * 4


def roofline_ms(flops: int, nbytes: int, peaks: dict) -> float:
    return max(flops / (peaks["gemm_tflops"] * 1e12), nbytes / (peaks["copy_gbs"] * 1e9)) * 1e3


def pct_of_mma_ceiling(tflops: float | None, bound: str, peaks: dict) -> float | None:
    """A compute-bound timing's TFLOP/s over the mma.sync ceiling (peaks["mma_tflops"]); None on a memory-bound
    shape, for an untimed cell, or where the peaks have no mma.sync ceiling (measured before it was, or not here)."""
    ceiling = peaks.get("mma_tflops")
    if bound != "compute" or tflops is None or not ceiling:
        return None
    return tflops / ceiling


def grid(models, tps, budgets, prefixes, batches, page_size=64, kv_dtype="bf16", out_dtype="bf16",
         family="ddtree", profile="mixed", seed=0) -> list[CaseSpec]:
    """Cases from option lists: every (model, tp, budget, prefix, batch); a batch of B repeats P."""
    specs = []
    for m, tp, bud, p, b in itertools.product(models, tps, budgets, prefixes, batches):
        mod = presets.model(m)
        fam = "root" if bud == 0 and family == "ddtree" else family
        specs.append(CaseSpec(model=mod.name, heads=mod.heads_per_gpu(tp), prefix_lens=(p,) * b, family=fam,
                              budget=bud, profile=profile, page_size=page_size, kv_dtype=kv_dtype,
                              out_dtype=out_dtype, seed=seed))
    return specs


@dataclass
class Cell:
    """One implementation on one shape."""

    impl: str
    """Kernel or baseline name."""
    status: str
    """"ok", or why it was not timed (FAIL_NUMERIC..., "error: ...", "skipped: ...")."""
    median_ms: float | None = None
    """Median device time."""
    iqr_ms: float | None = None
    """Interquartile range of the repetitions."""
    reps: int = 0
    """Timed repetitions."""
    tflops: float | None = None
    """Visible FLOPs / median time."""
    gbs: float | None = None
    """Minimum bytes / median time."""
    pct_roofline: float | None = None
    """Roofline time / median time."""
    speedup: float | None = None
    """First timed baseline's median / this median."""
    graph_status: str | None = None
    """--graph: "ok", or why there is no graph timing ("skipped: ...", "FAIL_NUMERIC under graph replay ...",
    "CAPTURE_ERROR: ...", "error: ..."); None: not asked for (no --graph, or a report from before it)."""
    graph_ms: float | None = None
    """--graph: the median replay of the graph of graph_layers launches, divided by graph_layers: per launch."""
    graph_iqr_ms: float | None = None
    """--graph: interquartile range of the replays, divided by graph_layers."""
    graph_reps: int = 0
    """--graph: timed replays."""
    graph_layers: int = 0
    """--graph: launches (layers, each on its own cache) in the graph (kdtr/bench/graph.py layers_for)."""
    graph_pct_roofline: float | None = None
    """--graph: roofline time / graph_ms."""
    graph_vs_direct: float | None = None
    """--graph: graph_ms / median_ms, the captured launch's time over the direct one (target <= 1.1)."""
    pct_mma_ceiling: float | None = None
    """Compute-bound shapes: tflops / the mma.sync ceiling (peaks' mma_tflops: an issue loop of the m16n8k16 bf16
    instruction flash uses); None on memory-bound shapes and in reports from before the ceiling was measured."""


@dataclass
class Row:
    """One shape of the sweep."""

    shape: str
    """Case name."""
    dims: dict
    """B, T, H, P, page, dtypes, budget, model."""
    flops: int
    """Visible-pair FLOPs."""
    nbytes: int
    """Minimum bytes."""
    roofline_ms: float
    """max(flops / GEMM peak, bytes / copy peak)."""
    bound: str
    """"compute" or "memory": which floor is larger."""
    cells: list[Cell] = field(default_factory=list)
    """One per implementation, in the order given."""


def device_problem(spec: CaseSpec, seed: int = 0):
    """The shape's layout on the GPU with fresh random q and cache drawn from ``seed`` (bench inputs, never zeros):
    what every timing of a shape runs on."""
    from kdtr.kernels.launch import DeviceProblem

    dp = DeviceProblem(build_problem(spec, values=False)[0], spec.out_dtype)
    dp.randomize(seed)
    return dp


def bench_shape(spec: CaseSpec, impls: list, peaks: dict, seed: int = 0, check: bool = True, time_kw=None,
                graph: bool = False) -> Row:
    """Check, then time every implementation on one shape (all on the same device inputs); with ``graph``, then
    time each one's launches captured in a CUDA graph too (kdtr/bench/graph.py)."""
    from kdtr.check.compare import compare
    from kdtr.bench.timing import l2_flush_bytes, time_launcher
    from kdtr.golden.tolerances import default
    from kdtr.inputs.trees import make_tree

    dp = device_problem(spec, seed)
    layout = dp.problem
    flops, nbytes = visible_flops(layout.prefix_lens, layout.tree_depth, layout.H), min_bytes(layout, spec.out_dtype)
    roof = roofline_ms(flops, nbytes, peaks)
    bound = "compute" if flops / (peaks["gemm_tflops"] * 1e12) > nbytes / (peaks["copy_gbs"] * 1e9) else "memory"
    row = Row(spec.name, {"B": spec.B, "T": spec.T, "H": spec.H, "P": max(spec.prefix_lens), "budget": spec.budget,
                          "model": spec.model, "page": spec.page_size, "kv": spec.kv_dtype, "out": spec.out_dtype},
              flops, nbytes, roof, bound)
    want = _gate_reference(dp, spec) if check else None
    other_wants = {}  # tree family -> reference, for peers whose mask is another tree's (tree_family)
    flush = l2_flush_bytes(peaks.get("l2_bytes"))
    base_ms = None
    for impl in impls:
        cell = Cell(impl.name, "ok")
        why = impl.caps.why_not(layout, spec.out_dtype) or getattr(impl, "untimed", None)
        if why:
            cell.status = f"skipped: {why}"
            row.cells.append(cell)
            continue
        try:
            if want is not None:
                got = impl.run_on(dp) if hasattr(impl, "run_on") else impl.run(dp.download_inputs(), spec.out_dtype)
                family = getattr(impl, "tree_family", None)
                if family and family not in other_wants:
                    other_wants[family] = _gate_reference(dp.with_tree(make_tree(family, budget=layout.T - 1)), spec)
                chk = compare(got.out, other_wants[family] if family else want,
                              default(spec.kv_dtype, spec.out_dtype, "out"))
                if chk.status.failed:
                    cell.status = f"{chk.status.value}: {chk.message}"
                    row.cells.append(cell)
                    continue
            t = time_launcher(impl.prepare(dp), flush_bytes=flush, **(time_kw or {}))
        except Exception as e:  # OOM, compile failure of a baseline...: the cell says so, the sweep goes on
            cell.status = f"error: {type(e).__name__}: {' '.join(str(e).split())[:160]}"
            row.cells.append(cell)
            continue
        ms = t["median_ms"]
        cell.median_ms, cell.iqr_ms, cell.reps = ms, t["iqr_ms"], t["reps"]
        cell.tflops, cell.gbs = flops / (ms * 1e-3) / 1e12, nbytes / (ms * 1e-3) / 1e9
        cell.pct_roofline = roof / ms
        cell.pct_mma_ceiling = pct_of_mma_ceiling(cell.tflops, bound, peaks)
        if base_ms is None and impl.name.startswith("torch-"):
            base_ms = ms
        row.cells.append(cell)
    if graph:
        from kdtr.bench.graph import time_graphs

        time_graphs(dp, spec, impls, row, want, kv_bytes(layout), seed=seed, flush_bytes=flush, time_kw=time_kw,
                    check=check)
    for c in row.cells:
        if c.median_ms and base_ms:
            c.speedup = base_ms / c.median_ms
    return row


def _gate_reference(dp, spec: CaseSpec) -> np.ndarray:
    """[B, T, H, 512] float64 of ``dp`` (its own tree, which may differ from ``spec``'s): exact CPU reference
    for small shapes, else the naive fp32 kernel."""
    from kdtr.kernels.registry import resolve_kernel
    from kdtr.golden.reference import reference

    keys = max(spec.prefix_lens) + spec.T
    if spec.B * spec.T * spec.H * keys <= EXACT_REF_LIMIT:
        return reference(dp.download_inputs())[0]
    return resolve_kernel("naive").run_on(dp).out.astype(np.float64)


def compare_runs(old: dict, new: dict, noise: float = 0.02) -> list[dict]:
    """Per (shape, impl) change new/old, flagged only beyond the measured spread of both runs; where both runs
    timed the cell's graph (--graph), its per-launch time the same way (graph_*; None otherwise)."""
    def cells(rep):
        return {(r["shape"], c["impl"]): c for r in rep["rows"] for c in r["cells"] if c.get("median_ms")}

    a, b = cells(old), cells(new)
    out = []
    for key in sorted(set(a) & set(b)):
        o, n = a[key], b[key]
        ch = _change(o["median_ms"], n["median_ms"], o["iqr_ms"], n["iqr_ms"], noise)
        g = (_change(o["graph_ms"], n["graph_ms"], o.get("graph_iqr_ms") or 0.0, n.get("graph_iqr_ms") or 0.0, noise)
             if o.get("graph_ms") and n.get("graph_ms") else {})
        out.append({"shape": key[0], "impl": key[1], "old_ms": o["median_ms"], "new_ms": n["median_ms"], **ch,
                    "old_graph_ms": o.get("graph_ms") if g else None, "new_graph_ms": n.get("graph_ms") if g else None,
                    "graph_ratio": g.get("ratio"), "graph_change": g.get("change")})
    return out


def _change(old_ms: float, new_ms: float, old_iqr: float, new_iqr: float, noise: float) -> dict:
    """ratio old/new, and whether the change passes the mean IQR plus ``noise`` of the old median."""
    spread = (old_iqr + new_iqr) / 2 + noise * old_ms
    delta = new_ms - old_ms
    return {"ratio": old_ms / new_ms, "significant": abs(delta) > spread,
            "change": "faster" if delta < -spread else "slower" if delta > spread else "same"}


GRAPH_CSV = ("graph_status", "graph_ms", "graph_iqr_ms", "graph_layers", "graph_pct_roofline", "graph_vs_direct")
"""The graph columns of a CSV line, present where any cell of the run was asked for one (--graph)."""


def to_csv_rows(rows: list[Row]) -> list[dict]:
    graph = any(c.graph_status is not None for r in rows for c in r.cells)
    flat = []
    for r in rows:
        for c in r.cells:
            flat.append({"shape": r.shape, **r.dims, "flops": r.flops, "bytes": r.nbytes, "roofline_ms": r.roofline_ms,
                         "bound": r.bound, "impl": c.impl, "status": c.status, "median_ms": c.median_ms,
                         "iqr_ms": c.iqr_ms, "tflops": c.tflops, "gbs": c.gbs, "pct_roofline": c.pct_roofline,
                         "pct_mma_ceiling": c.pct_mma_ceiling, "speedup": c.speedup,
                         **({k: getattr(c, k) for k in GRAPH_CSV} if graph else {})})
    return flat


def rows_from_json(rows: list[dict]) -> list[Row]:
    """The Rows of a saved bench report (its JSON "rows"); a report from before --graph has no graph fields,
    which read as not asked for, and one from before the mma.sync ceiling no pct_mma_ceiling (None)."""
    return [Row(**{**r, "cells": [Cell(**c) for c in r["cells"]]}) for r in rows]


def csv_text(rows: list[Row]) -> str:
    """One CSV line per (shape, impl), with a header; "" for no rows."""
    import csv
    import io

    flat, buf = to_csv_rows(rows), io.StringIO()
    if flat:
        w = csv.DictWriter(buf, fieldnames=list(flat[0]))
        w.writeheader()
        w.writerows(flat)
    return buf.getvalue()


def plot(rows: list[Row], path: str, metric: str = "pct_roofline") -> None:
    """% of roofline (or TFLOP/s) vs prefix length: one line per kernel, one panel per budget."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budgets = sorted({r.dims["budget"] for r in rows})
    impls = list(dict.fromkeys(c.impl for r in rows for c in r.cells))
    batches = sorted({r.dims["B"] for r in rows})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    fig, axes = plt.subplots(1, len(budgets), figsize=(4.2 * len(budgets), 3.8), squeeze=False)
    handles = {}
    for ax, bud in zip(axes[0], budgets):
        sub = [r for r in rows if r.dims["budget"] == bud]
        for i, impl in enumerate(impls):
            for j, bsz in enumerate(batches):
                pts = sorted((r.dims["P"], getattr(c, metric)) for r in sub if r.dims["B"] == bsz
                             for c in r.cells if c.impl == impl and getattr(c, metric))
                if pts:
                    (line,) = ax.plot(*zip(*pts), marker="o", color=colors[i % len(colors)],
                                      linestyle=("-", "--", ":", "-.")[j % 4])
                    handles[f"{impl} B={bsz}"] = line
        heads = sorted({r.dims["H"] for r in sub})
        ax.set_xscale("log", base=2)
        ax.set_title(f"budget {bud} (T = {bud + 1}), H = {','.join(map(str, heads))}")
        ax.set_xlabel("prefix length")
        ax.set_ylabel("% of roofline" if metric == "pct_roofline" else metric)
        if metric == "pct_roofline":
            ax.yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
        ax.grid(alpha=0.3)
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=min(6, len(handles)), fontsize=8)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(path, dpi=130)

