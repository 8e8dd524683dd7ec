"""`kdtr bench --graph` (kdtr/bench/graph.py): how many layers, what is captured, which cells get a graph timing,
and the graph fields through JSON, CSV, the table, compare and tools/summary.py. The timings themselves are
@pytest.mark.gpu (tests/bench/test_gpu_graph.py)."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from kdtr.bench import graph, run
from kdtr.inputs.cases import CaseSpec, build_problem
from kdtr.inputs.trees import unpack_mask

ROOT = Path(__file__).resolve().parents[2]
RESULTS = sorted((ROOT / "benchmarks" / "results").glob("bench*.json"))
MB, GB = 1 << 20, 1 << 30
H200 = {"l2_bytes": 60 * MB, "memory_bytes": 141 * GB}


# ---- how many layers ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("kv", [1 * MB, 9_500_000, 37_700_000, 75 * MB, 239 * MB, 241 * MB, 5 * GB])
def test_layers_are_the_fewest_whose_caches_pass_four_l2s(kv):
    n = graph.layers_for(kv, kv + MB, **H200)
    if n < graph.MAX_LAYERS:
        assert n * kv >= graph.L2_MULTIPLE * H200["l2_bytes"] or n == 2  # cold: four L2s of KV between reads
        assert n == 2 or (n - 1) * kv < graph.L2_MULTIPLE * H200["l2_bytes"]  # and no more layers than that
    assert 2 <= n <= graph.MAX_LAYERS


def test_layer_counts_on_the_bench_sets():
    assert graph.layers_for(9_500_000, 12 * MB, **H200) == 27  # DeepSeek P8k B1: 27 x 9.5 MB >= 4 x 60 MiB > 26 x
    assert graph.layers_for(1 * MB, 2 * MB, **H200) == graph.MAX_LAYERS  # tiny caches: capped at 64
    assert graph.layers_for(5 * GB, 5 * GB, **H200) == 2  # Kimi P128k B32: two layers already pass the L2 by far


def test_memory_caps_the_layers_and_one_layer_is_the_floor():
    # a quarter of 80 GB holds three 6 GB layers, not the 26 the L2 asks for
    assert graph.layers_for(9_500_000, 6 * GB, l2_bytes=60 * MB, memory_bytes=80 * GB) == 3
    assert graph.layers_for(9_500_000, 30 * GB, l2_bytes=60 * MB, memory_bytes=80 * GB) == 1
    assert graph.layers_for(0, MB, l2_bytes=60 * MB, memory_bytes=80 * GB) == graph.MAX_LAYERS


def test_layer_bytes_are_the_device_buffers_of_one_layer():
    p, _ = build_problem(CaseSpec(heads=4, prefix_lens=(100, 30), budget=8, page_size=16), values=False)
    rows = p.B * p.T * p.H
    host = p.q.nbytes + p.kv_cache.nbytes + p.block_table.nbytes + p.prefix_lens.nbytes + p.tree_mask.nbytes
    assert graph.layer_bytes(p, "bf16") == host + rows * 512 * 2 + rows * 4
    assert graph.layer_bytes(p, "fp32") == graph.layer_bytes(p, "bf16") + rows * 512 * 2
    assert run.kv_bytes(p) == (100 + 9 + 30 + 9) * 576 * 2 < p.kv_cache.nbytes  # read once; unowned slots not read


# ---- what is captured ---------------------------------------------------------------------------------------

def test_capture_holds_prefix_one_and_a_chain_in_the_real_buffers():
    p, _ = build_problem(CaseSpec(heads=2, prefix_lens=(70, 5), budget=8, page_size=16), values=False)
    cap = graph.capture_problem(p)
    assert graph.CAPTURE_FILL == 1 and graph.METHOD["capture_prefix_len"] == 1
    assert cap.prefix_lens.tolist() == [1, 1] and cap.prefix_lens.dtype == np.int32
    for b in range(p.B):
        assert (unpack_mask(cap.tree_mask[b], p.T) == np.tril(np.ones((p.T, p.T), bool))).all()  # t sees 0..t
        assert cap.tree_depth[b].tolist() == list(range(p.T))
    assert cap.block_table is p.block_table and cap.kv_cache is p.kv_cache and cap.q is p.q  # same buffers
    cap.validate()
    full, _ = build_problem(CaseSpec(heads=2, prefix_lens=(0,), family="chain", budget=15, page_size=16), values=False)
    assert graph.capture_problem(full) is None  # 1 + 16 tokens do not fit the one page a 0 + 16 shape holds


# ---- which cells get a graph timing -----------------------------------------------------------------------------

def _cell(status="ok", ms=0.1):
    return run.Cell("x", status, ms if status == "ok" else None, 0.001 if status == "ok" else None, 10)


def test_only_prepared_cuda_launches_are_captured():
    from kdtr.bench.baselines import baseline
    from kdtr.kernels.registry import resolve_kernel

    assert "torch baseline" in graph.not_capturable(baseline("torch-eager"), _cell())
    assert "no prepared CUDA launch" in graph.not_capturable(resolve_kernel("emulate-flash"), _cell())
    assert "no prepared CUDA launch" in graph.not_capturable(
        resolve_kernel(str(ROOT / "docs" / "examples" / "my_verify.py") + ":verify"), _cell())
    for name in ("naive", "flash", "flash-sm90", "naive-bug=baked-lengths", "flash[splits=4]"):
        assert graph.not_capturable(resolve_kernel(name), _cell()) is None, name
    assert graph.not_capturable(resolve_kernel("flash"), _cell("FAIL_NUMERIC: out")) == "the direct launch was not timed"


class _Prepared:
    """Has a prepared launch; any use of it fails the test (nothing may reach the GPU on these paths)."""

    name = "fake"

    def prepare(self, dp, workspace=None):
        raise AssertionError("prepared")

    def steps(self, dp):
        raise AssertionError("planned")


def test_cells_that_cannot_be_captured_say_why_without_a_gpu():
    from kdtr.bench.baselines import baseline

    p, _ = build_problem(CaseSpec(heads=2, prefix_lens=(64,), budget=4, page_size=16), values=False)
    row = run.Row("s", {}, 1, 1, 0.01, "memory", [_cell(), _cell("error: boom")])
    graph.time_graphs(SimpleNamespace(problem=p, out_dtype="bf16"), None, [baseline("torch-eager"), _Prepared()],
                      row, None, run.kv_bytes(p))
    assert row.cells[0].graph_status.startswith("skipped: a torch baseline")
    assert row.cells[1].graph_status == "skipped: the direct launch was not timed"
    assert all(c.graph_ms is None and c.graph_layers == 0 for c in row.cells)

    full, _ = build_problem(CaseSpec(heads=2, prefix_lens=(0,), family="chain", budget=15, page_size=16), values=False)
    row = run.Row("s", {}, 1, 1, 0.01, "memory", [_cell()])
    graph.time_graphs(SimpleNamespace(problem=full, out_dtype="bf16"), None, [_Prepared()], row, None, run.kv_bytes(full))
    assert "cannot hold the capture length 1 + T" in row.cells[0].graph_status


# ---- the graph fields in the report -------------------------------------------------------------------------

DIMS = {"B": 1, "T": 65, "H": 16, "P": 8192, "budget": 64, "model": "deepseek-v3", "page": 64, "kv": "bf16", "out": "bf16"}


def graph_report(graph_ms=0.105, fail=False) -> dict:
    ok = run.Cell("flash", "ok", 0.1, 0.001, 20, 100.0, 90.0, 0.5, 3.0, "ok", graph_ms, 0.0005, 30, 26, 0.476,
                  graph_ms / 0.1)
    if fail:
        ok = run.Cell("flash", "ok", 0.1, 0.001, 20, 100.0, 90.0, 0.5, 3.0,
                      "FAIL_NUMERIC under graph replay (layer 3 of 26): out: worst (0, 1, 2, 3)", graph_layers=26)
    eager = run.Cell("torch-eager", "ok", 0.3, 0.003, 10, 33.0, 30.0, 0.17, 1.0,
                     "skipped: a torch baseline runs eager Python, with no prepared launch to capture")
    row = run.Row("dsv3-x", DIMS, 10**10, 2 * 10**7, 0.05, "compute", [eager, ok])
    return {"peaks": {"device": "NVIDIA H200", "copy_gbs": 4200.0, "gemm_tflops": 765.0}, "rows": [asdict(row)],
            "impls": ["torch-eager", "flash"], "graph": {**graph.METHOD, "checked": True}}


def test_graph_fields_survive_json():
    d = json.loads(json.dumps(graph_report()))
    (row,) = run.rows_from_json(d["rows"])
    flash = row.cells[1]
    assert (flash.graph_status, flash.graph_ms, flash.graph_layers, flash.graph_reps) == ("ok", 0.105, 26, 30)
    assert flash.graph_iqr_ms == 0.0005 and flash.graph_vs_direct == pytest.approx(1.05)
    assert asdict(row) == d["rows"][0]


@pytest.mark.parametrize("path", RESULTS, ids=lambda p: p.name)
def test_reports_from_before_graph_still_load(path):
    from kdtr.cli.bench import load_bench_report

    d = load_bench_report(str(path))
    rows = run.rows_from_json(d["rows"])
    assert rows and all(c.graph_status is None and c.graph_ms is None and c.graph_layers == 0
                        for r in rows for c in r.cells)
    assert "graph" not in run.csv_text(rows).splitlines()[0]  # the CSV of an old run is what it was


def test_csv_carries_the_graph_columns_where_asked():
    import csv
    import io

    eager, flash = csv.DictReader(io.StringIO(run.csv_text(run.rows_from_json(graph_report()["rows"]))))
    assert list(flash)[-len(run.GRAPH_CSV):] == list(run.GRAPH_CSV)
    assert (flash["graph_status"], flash["graph_ms"], flash["graph_layers"]) == ("ok", "0.105", "26")
    assert eager["graph_status"].startswith("skipped: a torch baseline") and eager["graph_ms"] == ""


def test_compare_carries_the_graph_time_where_both_runs_have_it():
    old, new = graph_report(0.2), graph_report(0.1)
    (eager, flash) = sorted(run.compare_runs(old, new), key=lambda c: c["impl"] != "torch-eager")
    assert flash["graph_change"] == "faster" and flash["graph_ratio"] == pytest.approx(2.0)
    assert (flash["old_graph_ms"], flash["new_graph_ms"]) == (0.2, 0.1) and flash["change"] == "same"
    assert eager["graph_change"] is None and eager["old_graph_ms"] is None
    before = json.loads(RESULTS[0].read_text())
    assert all(c["graph_change"] is None for c in run.compare_runs(before, before))


def test_table_shows_the_graph_column_beside_the_direct_time(capsys):
    from kdtr.cli.bench import render_bench

    render_bench(graph_report())
    out = capsys.readouterr().out
    header = next(ln for ln in out.splitlines() if "impl" in ln)
    assert header.index("time us") < header.index("graph us") < header.index("graph/direct") < header.index("TFLOP/s")
    flash = next(ln for ln in out.splitlines() if " flash " in ln)
    assert "105.0" in flash and "1.05x" in flash and " 26 " in flash
    assert "captured in one CUDA graph at prefix length 1" in out and "checked before timing" in out

    render_bench(graph_report(fail=True))
    out = capsys.readouterr().out
    flash = next(ln for ln in out.splitlines() if " flash " in ln)
    assert "FAIL_NUMERIC" in flash and "graph failures" in out and "layer 3 of 26" in out

    before = json.loads(RESULTS[0].read_text())
    render_bench(before)
    assert "graph" not in capsys.readouterr().out  # no --graph: the table it always was


def test_bench_json_records_how_the_graph_was_timed():
    from kdtr.cli.bench import bench_run

    d = bench_run([], [], [], {"device": "x"}, check=False, progress=False, graph=True)
    assert d["graph"]["capture_prefix_len"] == 1 and d["graph"]["checked"] is False
    assert d["graph"]["l2_multiple"] == graph.L2_MULTIPLE and d["graph"]["max_layers"] == graph.MAX_LAYERS
    assert "graph" not in bench_run([], [], [], {"device": "x"}, check=True, progress=False)


def _summary():
    spec = importlib.util.spec_from_file_location("kdtr_tools_summary", ROOT / "tools" / "summary.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


TARGETS = {"compute": 0.5, "memory": 0.75, "eager": 5.0, "graph": 1.1}


def test_summary_carries_the_graph_column_and_its_target():
    s = _summary()
    lines = s.bench_lines([("a.json", graph_report(0.105))], TARGETS, 5)
    assert "flash graph" in lines[1] and "torch-eager graph" not in lines[1]  # baselines are never captured
    assert "105.0   1.05x" in lines[2]
    assert "graph <= 1.1x direct: 1 of 1" in "\n".join(lines)
    slow = "\n".join(s.bench_lines([("a.json", graph_report(0.13))], TARGETS, 5))
    assert "graph <= 1.1x direct: 0 of 1" in slow and "miss graph <= 1.1x direct: deepseek-v3 T65 P8k B1: 1.30x" in slow
    failed = "\n".join(s.bench_lines([("a.json", graph_report(fail=True))], TARGETS, 5))
    assert "FAIL_NUMERIC" in failed and "0 of 1" in failed
    old = "\n".join(s.bench_lines([("b.json", json.loads(RESULTS[0].read_text()))], TARGETS, 5))
    assert "graph" not in old


def test_summary_says_which_reports_were_stopped(tmp_path):
    s = _summary()
    whole, stopped = graph_report(), {**graph_report(), "partial": {"timed": 1, "of": 4}}
    lines = s.bench_lines([("compute.json", whole), ("memory.json", stopped)], TARGETS, 5)
    assert lines[0] == "bench STOPPED, shapes timed: memory 1 of 4"
    assert not s.bench_lines([("compute.json", whole)], TARGETS, 5)[0].startswith("bench STOPPED")
    s.merge([("compute.json", whole), ("memory.json", stopped)], str(tmp_path / "m.json"), None, None)
    assert json.loads((tmp_path / "m.json").read_text())["partial"] == {"timed": 2, "of": 5}
    s.merge([("compute.json", stopped), ("memory.json", whole)], str(tmp_path / "w.json"), None, None)
    assert json.loads((tmp_path / "w.json").read_text())["partial"] == {"timed": 2, "of": 5}
    s.merge([("compute.json", whole), ("memory.json", whole)], str(tmp_path / "n.json"), None, None)
    assert "partial" not in json.loads((tmp_path / "n.json").read_text())
    rep = {"kernel": "flash", "counts": {"PASS": 3}, "results": [], "failed": True, "seconds": 1.0,
           "partial": {"verified": 3, "of": 23}}
    assert s.verify_lines([("ci.json", rep)])[0].endswith("FAILED  STOPPED after 3 of 23 cases")
