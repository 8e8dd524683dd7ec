"""`kdtr bench --graph` on a GPU: the launches of L layers captured at prefix length 1 and replayed at the real
lengths are checked before they are timed, a launch that bakes the lengths in fails, one that capture refuses
says so, and the direct inputs hold their real lengths afterwards."""

from __future__ import annotations

import json

import pytest

from kdtr.bench import graph, run
from kdtr.inputs.cases import CaseSpec
from kdtr.kernels.registry import resolve_kernel

pytestmark = pytest.mark.gpu

FAST = {"warmup_ms": 5.0, "budget_ms": 150.0}
"""Short timings: these tests judge what is timed, not how fast."""
PEAKS = {"gemm_tflops": 700.0, "copy_gbs": 4000.0}
SPEC = CaseSpec(model="kimi-k2", heads=8, prefix_lens=(1000, 3000), budget=8, page_size=64)
"""Two requests of a DDTree-8 tree over mixed prefixes: flash splits the longer one's keys."""


def expected_layers(spec: CaseSpec) -> int:
    from kdtr.inputs.cases import build_problem
    from kdtr.kernels.launch import device_info

    p = build_problem(spec, values=False)[0]
    info = device_info()
    return graph.layers_for(run.kv_bytes(p), graph.layer_bytes(p, spec.out_dtype), info["l2_bytes"], info["memory_bytes"])


def test_correct_kernels_replay_right_and_are_timed_per_launch():
    impls = [resolve_kernel(k) for k in ("naive", "flash", "flash-sm90")]
    row = run.bench_shape(SPEC, impls, PEAKS, time_kw=FAST, graph=True)
    n = expected_layers(SPEC)
    assert n >= 2
    for cell in row.cells:
        if cell.status.startswith("skipped"):  # flash-sm90 off sm_90
            assert cell.graph_status == "skipped: the direct launch was not timed"
            continue
        assert cell.status == "ok" and cell.graph_status == "ok", (cell.impl, cell.graph_status)
        assert cell.graph_layers == n and cell.graph_reps >= 3 and cell.graph_ms > 0
        assert cell.graph_pct_roofline == pytest.approx(row.roofline_ms / cell.graph_ms)
        # events on another stream than the replay's would time nothing: a per-launch time far below the direct one
        assert 0.2 < cell.graph_vs_direct < 5, (cell.impl, cell.graph_ms, cell.median_ms)


def test_a_launch_that_bakes_the_lengths_in_fails_under_replay_and_lengths_come_back():
    dp = run.device_problem(SPEC, 0)
    real_mask = dp.tree_mask.get()
    impls = [resolve_kernel("naive-bug=baked-lengths"), resolve_kernel("naive")]
    row = run.Row("s", {}, 1, 1, 1e-3, "memory", [run.Cell(i.name, "ok", 0.1, 0.0, 1) for i in impls])
    graph.time_graphs(dp, SPEC, impls, row, run._gate_reference(dp, SPEC), run.kv_bytes(dp.problem), time_kw=FAST)
    baked, good = row.cells
    assert "under graph replay (layer 0 of" in baked.graph_status and baked.graph_ms is None, baked.graph_status
    assert baked.graph_status.split()[0] in ("FAIL_NUMERIC", "NAN", "UNWRITTEN")
    assert good.graph_status == "ok" and good.graph_ms > 0
    assert dp.prefix_lens.get().tolist() == list(SPEC.prefix_lens) == dp.problem.prefix_lens.tolist()
    assert (dp.tree_mask.get() == real_mask).all()


class SyncingNaive:
    """naive, with a launch that waits for the device: right when run directly, refused by capture."""

    def __init__(self):
        self.inner, self.name = resolve_kernel("naive"), "syncing-naive"
        self.caps = self.inner.caps

    def steps(self, dp):
        return self.inner.steps(dp)

    def prepare(self, dp, workspace=None):
        from kdtr.kernels.launch import cupy_module

        go = self.inner.prepare(dp, workspace=workspace)

        def launch():
            go()
            cupy_module().cuda.runtime.deviceSynchronize()
        return launch


def test_a_launch_capture_refuses_is_a_capture_error():
    dp = run.device_problem(SPEC, 0)
    impl = SyncingNaive()
    row = run.Row("s", {}, 1, 1, 1e-3, "memory", [run.Cell(impl.name, "ok", 0.1, 0.0, 1)])
    graph.time_graphs(dp, SPEC, [impl], row, None, run.kv_bytes(dp.problem), time_kw=FAST, check=False)
    assert row.cells[0].graph_status.startswith("CAPTURE_ERROR"), row.cells[0].graph_status
    assert dp.prefix_lens.get().tolist() == list(SPEC.prefix_lens)


def test_the_command_writes_the_graph_column_and_fields(kdtr, tmp_path):
    out = tmp_path / "b.json"
    r = kdtr("bench", "-k", "naive", "--prefix", "2k", "--budget", "4", "--model", "kimi-k2", "--baselines", "none",
             "--graph", "--json", out)
    assert r.exit_code == 0, r.output
    assert "graph us" in r.stdout and "graph/direct" in r.stdout
    d = json.loads(out.read_text())
    assert d["graph"]["capture_prefix_len"] == 1 and d["graph"]["checked"] is True
    (cell,) = d["rows"][0]["cells"]
    assert cell["graph_status"] == "ok" and cell["graph_layers"] >= 2 and cell["graph_ms"] > 0
    assert kdtr("bench", "compare", out, out).exit_code == 0
