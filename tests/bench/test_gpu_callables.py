"""`kdtr bench -k module:fn` on a GPU times Python callables like the built-in kernels: cupy and torch callables
in kdtr's layout and a torch callable in SGLang's layout (through kdtr.adapters.sglang) are checked, then timed
by CUDA events around a launcher that only calls them; a CPU callable SKIPs, saying why."""

from __future__ import annotations

import json

import pytest

from conftest import ROOT
from kdtr.bench import run
from kdtr.inputs.cases import CaseSpec
from kdtr.kernels.registry import resolve_kernel

pytestmark = pytest.mark.gpu

FAST = {"warmup_ms": 5.0, "budget_ms": 150.0}
PEAKS = {"gemm_tflops": 700.0, "copy_gbs": 4000.0}
SPEC = CaseSpec(model="kimi-k2", heads=2, prefix_lens=(100, 300), budget=4, page_size=16)
GRAPH_KERNELS = ROOT / "tests" / "check" / "graph_kernels.py"
CALLABLES = [f"{GRAPH_KERNELS}:cupy_correct", f"{GRAPH_KERNELS}:torch_correct",
             f"{ROOT / 'tests' / 'adapters' / 'sglang_torch_kernels.py'}:attend"]


def test_python_callables_are_checked_and_timed_like_built_ins():
    pytest.importorskip("torch")
    impls = [resolve_kernel(k) for k in CALLABLES] + [resolve_kernel("naive")]
    row = run.bench_shape(SPEC, impls, PEAKS, time_kw=FAST)
    for cell in row.cells:
        assert cell.status == "ok", (cell.impl, cell.status)
        assert cell.median_ms > 0 and cell.reps >= 2 and cell.pct_roofline > 0, cell


def test_a_cpu_callable_is_skipped_with_the_reason():
    row = run.bench_shape(SPEC, [resolve_kernel(f"{ROOT / 'docs' / 'examples' / 'my_verify.py'}:verify")], PEAKS,
                          time_kw=FAST)
    assert row.cells[0].status.startswith("skipped: a CPU callable") and row.cells[0].median_ms is None


def test_kdtr_bench_times_a_callable_from_the_command_line(kdtr):
    r = kdtr("bench", "-k", CALLABLES[0], "--model", "kimi-k2", "--tp", "8", "--prefix", "256", "--budget", "4",
             "--baselines", "none", "--json", "-")
    assert r.exit_code == 0, r.output
    cells = json.loads(r.stdout)["rows"][0]["cells"]
    assert cells[0]["status"] == "ok" and cells[0]["median_ms"] > 0, cells
