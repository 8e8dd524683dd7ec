"""`kdtr bench --graph`: the serving view of a timing, a model's layers captured in one CUDA graph and replayed.

A server runs the verify launch once per layer and captures the whole step in a CUDA graph at dummy lengths
(SPEC section 8): L launches of one shape, each on its own layer's cache, one workspace for all of them.
Per shape, for each implementation whose direct launch was timed and that has a prepared CUDA launch
(``prepare`` and ``steps``: the built-in and file.cu kernels; torch baselines and Python callables get "-"
with the reason):

1. L layers: the shape's layout L times, each with its own random q and cache (layer 0 holds the direct
   timing's inputs, layer i values drawn from seed + i). L is the smallest count >= 2 whose caches together
   reach L2_MULTIPLE x the L2, so that each launch finds its layer cold as after a model's other layers, at
   most MAX_LAYERS and within MEMORY_FRACTION of the GPU's memory (layers_for). Built once per shape.
2. Capture at the dummy length: every layer's buffers (and the host view the launch is planned from) hold
   prefix length CAPTURE_FILL in every request, SGLang's fill for its triton and FA3 backends, and a chain
   tree (node t sees nodes 0..t). Each layer's launcher is prepared there with the one shared zero-filled
   workspace, and all L are captured in one graph (kdtr.kernels.launch.capture).
3. The real lengths and trees are written back and the graph replayed once on poisoned outputs: every
   layer's output is checked with the direct gate's tolerances (layer 0 against the gate's own reference,
   the others against the naive fp32 kernel, the gate's reference for large shapes). A wrong replay is a
   failed cell ("FAIL_NUMERIC under graph replay ..."), never a timing.
4. Replays timed as direct launches are (kdtr.bench.timing.time_launcher: warm-up by time, the L2 read-flushed,
   the GPU held while the host enqueues, a median over repetitions), everything on the graph's own stream,
   which the default stream does not wait for. The per-launch time is the replay's median / L.
"""

from __future__ import annotations

import math

import numpy as np

from kdtr.inputs.presets import DV, dtype_of

CAPTURE_FILL = 1
"""Every request's prefix length while the graph is captured: SGLang's dummy for its triton and FA3 backends,
fixed (a launch planned from lengths is planned for this one)."""
L2_MULTIPLE = 4
"""The layers' caches together pass this many L2s, so each launch reads its own layer's cache cold."""
MEMORY_FRACTION = 0.25
"""At most this share of the GPU's memory goes to the layers' buffers (q, cache, tables, out, lse)."""
MAX_LAYERS = 64
"""At most this many layers (launches) in one graph."""
METHOD = {"capture_prefix_len": CAPTURE_FILL, "capture_tree": "chain", "l2_multiple": L2_MULTIPLE,
          "memory_fraction": MEMORY_FRACTION, "max_layers": MAX_LAYERS, "workspace": "one, shared by every layer",
          "check": "every layer's output after the first replay"}
"""How --graph times, as recorded in bench JSON (with "checked": whether the replay was checked)."""


def layers_for(kv_bytes: int, layer_bytes: int, l2_bytes: int, memory_bytes: int) -> int:
    """How many layers a shape's graph holds: the smallest L >= 2 with L x ``kv_bytes`` (the KV one launch
    reads) >= L2_MULTIPLE x ``l2_bytes``, at most MAX_LAYERS and at most what MEMORY_FRACTION of
    ``memory_bytes`` holds of ``layer_bytes`` (one layer's device buffers); never below 1 (the direct
    timing's own inputs, already allocated)."""
    want = MAX_LAYERS if kv_bytes <= 0 else max(2, math.ceil(L2_MULTIPLE * l2_bytes / kv_bytes))
    fit = int(MEMORY_FRACTION * memory_bytes) // max(1, layer_bytes)
    return max(1, min(want, fit, MAX_LAYERS))


def layer_bytes(problem, out_dtype: str) -> int:
    """Device bytes of one layer (kdtr.kernels.launch.DeviceProblem of ``problem``): q, the whole paged cache
    (unowned slots too), block table, prefix lengths, tree mask, out and lse."""
    rows = problem.B * problem.T * problem.H
    ints = problem.block_table.size + problem.prefix_lens.size + problem.tree_mask.size
    return (problem.q.size + problem.kv_cache.size) * dtype_of(problem.kv_dtype).itemsize + 4 * ints \
        + rows * DV * dtype_of(out_dtype).itemsize + rows * 4


def capture_problem(problem):
    """``problem``'s buffers as they stand at capture: every prefix length CAPTURE_FILL and a chain tree;
    None where the block table cannot hold CAPTURE_FILL + T tokens (a prefix-0 shape with T a page multiple)."""
    from kdtr.check.graph import fill_problem

    return fill_problem(problem, CAPTURE_FILL)


def not_capturable(impl, cell) -> str | None:
    """Why ``impl`` gets no graph timing on this shape (its direct ``cell`` already filled), or None."""
    if cell.status != "ok" or cell.median_ms is None:
        return "the direct launch was not timed"
    if impl.name.startswith("torch-"):
        return "a torch baseline runs eager Python, with no prepared launch to capture"
    if not (callable(getattr(impl, "prepare", None)) and callable(getattr(impl, "steps", None))):
        return f"{impl.name} has no prepared CUDA launch (prepare and steps) to capture"
    return None


def time_graphs(dp, spec, impls: list, row, want, kv_bytes: int, seed: int = 0, flush_bytes: int = 0,
                time_kw=None, check: bool = True) -> None:
    """Fill the graph fields of ``row.cells`` (one per impl, in order; the direct timings done) as the module
    docstring says. ``dp``: the direct timing's inputs (layer 0); ``want``: its gate reference (None: not
    checked). dp's lengths and trees are the real ones again when this returns."""
    from kdtr.kernels.launch import cupy_module, device_info

    todo = []
    for impl, cell in zip(impls, row.cells):
        why = not_capturable(impl, cell)
        if why:
            cell.graph_status = f"skipped: {why}"
        else:
            todo.append((impl, cell))
    if not todo:
        return
    real, dummy = dp.problem, capture_problem(dp.problem)
    if dummy is None:
        for _, cell in todo:
            cell.graph_status = f"skipped: the block table cannot hold the capture length {CAPTURE_FILL} + T tokens"
        return
    info = device_info()
    n = layers_for(kv_bytes, layer_bytes(real, dp.out_dtype), info["l2_bytes"], info["memory_bytes"])
    layers, refs = [dp], [want]
    try:
        try:
            layers += _more_layers(dp, n - 1, seed)
            refs += _references(layers[1:]) if check else [None] * (n - 1)
        except Exception as e:  # out of memory, or the reference kernel failing: no cell can be timed
            for _, cell in todo:
                cell.graph_layers, cell.graph_status = n, _error(e)
            return
        for impl, cell in todo:
            cell.graph_layers = n
            try:
                _time_one(impl, cell, layers, refs, real, dummy, row.roofline_ms, flush_bytes, time_kw, check)
            except Exception as e:  # capture refused, a launch failing, out of memory: this cell says so
                cell.graph_status = _error(e)
            finally:
                _write_lengths(layers, real)
    finally:
        del layers[1:]
        cupy_module().get_default_memory_pool().free_all_blocks()  # the next shape's layers start from a clean pool


def _more_layers(dp, count: int, seed: int) -> list:
    """``count`` more layers of dp's layout, layer i (from 1) with q and cache drawn from ``seed + i``."""
    from kdtr.kernels.launch import DeviceProblem

    out = []
    for i in range(1, count + 1):
        layer = DeviceProblem(dp.problem, dp.out_dtype)
        layer.randomize(seed + i)
        out.append(layer)
    return out


def _references(layers: list) -> list[np.ndarray]:
    """Each layer's output by the naive fp32 kernel at the real lengths (float32 [B, T, H, 512]); run before
    any capture, since it writes the layers' output buffers."""
    from kdtr.kernels.registry import resolve_kernel

    naive = resolve_kernel("naive")
    return [naive.run_on(layer).out.astype(np.float32) for layer in layers]


def _write_lengths(layers: list, problem) -> None:
    """``problem``'s prefix lengths and tree masks into every layer's device buffers, and ``problem`` as their
    host view (what a launch is planned from); then wait, so that no stream runs ahead of the writes."""
    from kdtr.kernels.launch import cupy_module

    lens = np.ascontiguousarray(problem.prefix_lens, np.int32)
    mask = np.ascontiguousarray(problem.tree_mask, np.uint32)
    for layer in layers:
        layer.prefix_lens.set(lens)
        layer.tree_mask.set(mask)
        layer.problem = problem
    cupy_module().cuda.runtime.deviceSynchronize()


def _time_one(impl, cell, layers, refs, real, dummy, roofline_ms: float, flush_bytes: int, time_kw, check: bool) -> None:
    """Capture impl's L launches at the dummy lengths, check the first replay at the real ones, time replays."""
    from kdtr.bench.timing import time_launcher
    from kdtr.check.compare import compare
    from kdtr.golden.tolerances import default
    from kdtr.kernels.launch import capture, cupy_module, synchronize

    cp = cupy_module()
    _write_lengths(layers, dummy)
    ws_bytes = int(impl.steps(layers[0])[1])
    workspace = cp.zeros(ws_bytes, cp.uint8) if ws_bytes else None
    launchers = [impl.prepare(layer, workspace=workspace) for layer in layers]  # one workspace, as a server
    cp.cuda.runtime.deviceSynchronize()  # tables and workspace written before the capture begins

    def step():
        for go in launchers:
            go()

    graph = capture(step)
    _write_lengths(layers, real)
    for layer in layers:
        layer.poison()
    cp.cuda.runtime.deviceSynchronize()
    graph.replay()
    synchronize(cp, f"{impl.name} (graph replay)")
    if check:
        tol = default(real.kv_dtype, layers[0].out_dtype, "out")
        for i, (layer, want) in enumerate(zip(layers, refs)):
            chk = compare(layer.download()[0], np.asarray(want, np.float64), tol)
            if chk.status.failed:
                cell.graph_status = f"{chk.status.value} under graph replay (layer {i} of {len(layers)}): {chk.message}"
                return
    with graph.stream:  # flush, hold, events and replays on one stream: the events bracket the replay
        t = time_launcher(graph.replay, flush_bytes=flush_bytes, **(time_kw or {}))
    n = len(layers)
    cell.graph_ms, cell.graph_iqr_ms, cell.graph_reps = t["median_ms"] / n, t["iqr_ms"] / n, t["reps"]
    cell.graph_pct_roofline = roofline_ms / cell.graph_ms
    cell.graph_vs_direct = cell.graph_ms / cell.median_ms
    cell.graph_status = "ok"


def _error(e: Exception) -> str:
    """A graph cell's status for an exception: CAPTURE_ERROR for a launch capture refuses, else error."""
    from kdtr.kernels.launch import CaptureError

    text = " ".join(str(e).split())[:200]
    return f"CAPTURE_ERROR: {text}" if isinstance(e, CaptureError) else f"error: {type(e).__name__}: {text}"


__all__ = ["CAPTURE_FILL", "L2_MULTIPLE", "MAX_LAYERS", "MEMORY_FRACTION", "METHOD", "capture_problem", "layer_bytes",
           "layers_for", "not_capturable", "time_graphs"]
