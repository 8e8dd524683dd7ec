"""On a GPU: kdtr verify --graph with real CUDA graphs. The built-in kernels pass ci and the graph suite when
captured at a server's dummy lengths and replayed on each case; the planted baked-lengths bug passes a plain
verify and fails --graph on naive, flash and flash-sm90; a user .cu kernel, cupy and torch callables go
through the same capture, and a callable that synchronises inside its launch is CAPTURE_ERROR."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kdtr.check.compare import Status
from kdtr.check.suite import run_verify
from kdtr.golden.store import find_bundles
from kdtr.kernels.bugs import GRAPH_ONLY, Bug
from kdtr.kernels.registry import resolve_kernel, variant_name

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("hopper_only")]
KERNELS = ("naive", "flash", "flash-sm90")
ROOT = Path(__file__).resolve().parents[2]
CALLABLES = Path(__file__).resolve().parent / "graph_kernels.py"


@pytest.fixture(scope="module")
def paths():
    return find_bundles(["ci"]) + find_bundles(["graph"])


def _describe(rep):
    return [(r.case, r.status.value, r.message) for r in rep.results if r.status is not Status.PASS]


@pytest.mark.parametrize("name", KERNELS)
def test_builtin_kernel_passes_graph_on_ci_and_the_graph_suite(paths, name):
    rep = run_verify(resolve_kernel(name), paths, repeat=2, graph=True)
    assert not rep.failed, _describe(rep)
    passed = [r for r in rep.results if r.status is Status.PASS]
    assert len(passed) >= 20 and all(len(r.captures) >= 2 for r in passed)
    assert all(r.shape["kv"] == "fp32" for r in rep.results if r.status is Status.SKIPPED), _describe(rep)


@pytest.mark.parametrize("bug", GRAPH_ONLY, ids=lambda b: b.slug)
@pytest.mark.parametrize("name", KERNELS)
def test_graph_only_bug_passes_plain_verify_and_fails_graph(paths, name, bug: Bug):
    kernel = resolve_kernel(variant_name(name, bug))
    plain = run_verify(kernel, paths)
    assert not plain.failed, _describe(plain)
    rep = run_verify(kernel, paths, graph=True)
    taken = [r for r in rep.results if r.status is not Status.SKIPPED]
    assert taken and all(r.status in (Status.FAIL_NUMERIC, Status.NAN) for r in taken), _describe(rep)
    assert all(r.message.startswith("captured at ") for r in taken)


def test_a_user_cuda_kernel_passes_graph():
    spec = f"{ROOT / 'docs' / 'examples' / 'my_verify.cu'}:my_verify<{{kv}}, {{out}}>"
    rep = run_verify(resolve_kernel(spec), find_bundles(["graph"]), graph=True)
    assert not rep.failed and rep.counts == {"PASS": 10}, _describe(rep)


@pytest.mark.parametrize("fn", ["cupy_correct", "torch_correct"])
def test_graph_safe_callables_pass(fn):
    if fn.startswith("torch"):
        pytest.importorskip("torch")
    rep = run_verify(resolve_kernel(f"{CALLABLES}:{fn}"), find_bundles(["graph"]), graph=True)
    assert not rep.failed and rep.counts == {"PASS": 10}, _describe(rep)
    assert all(c.status is Status.PASS for r in rep.results for c in r.captures)


def test_a_callable_planning_on_host_lengths_fails_graph():
    kernel = resolve_kernel(f"{CALLABLES}:cupy_baked")
    paths = find_bundles(["graph"])
    assert not run_verify(kernel, paths).failed
    rep = run_verify(kernel, paths, graph=True)
    assert all(r.status in (Status.FAIL_NUMERIC, Status.NAN) for r in rep.results), _describe(rep)


@pytest.mark.parametrize("fn", ["cupy_syncs", "torch_item"])
def test_a_callable_that_syncs_in_its_launch_is_capture_error(fn):
    if fn.startswith("torch"):
        pytest.importorskip("torch")
    kernel = resolve_kernel(f"{CALLABLES}:{fn}")
    paths = find_bundles(["graph"])[:3]
    assert not run_verify(kernel, paths).failed
    rep = run_verify(kernel, paths, graph=True, isolate=True)  # a failed capture may leave the context unusable
    assert all(r.status is Status.CAPTURE_ERROR for r in rep.results), _describe(rep)
    assert all(c.status is Status.CAPTURE_ERROR for r in rep.results for c in r.captures)


def test_graph_through_the_command_line_in_children(kdtr, tmp_path):
    path = tmp_path / "r.json"
    r = kdtr("verify", "-k", "naive", "graph", "--graph", "--json", path)
    d = json.loads(path.read_text())
    assert r.exit_code == 0 and d["isolated"] and d["counts"] == {"PASS": 10}, r.output
    assert sum(bool(c["sibling"]) for res in d["results"] for c in res["captures"]) == 6
    assert all(c["ms"] > 0 for res in d["results"] for c in res["captures"])
    r = kdtr("verify", "-k", "naive-bug=baked-lengths", "graph", "--graph")
    assert r.exit_code == 1 and "captured at P=" in r.stdout
