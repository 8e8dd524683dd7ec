"""kdtr verify --graph on the CPU: the capture machinery (kdtr/check/graph.py) through emulate-flash's mock
capture, CPU Python callables, and fake kernels for the statuses a GPU would give (CAPTURE_ERROR, RACE, a slow
replay). The proof that it means something: the planted baked-lengths bug passes a plain verify and fails
--graph on every ci case emulate-flash takes, while the correct emulation passes ci and the graph suite."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from kdtr.check.case import CaseResult
from kdtr.check.compare import Status
from kdtr.check.graph import FILLS, buffer_key, capture_layouts, fill_problem, siblings, verify_graph
from kdtr.check.suite import run_verify
from kdtr.golden.bundle import load_bundle, read_meta
from kdtr.golden.store import find_bundles
from kdtr.inputs import suites, trees
from kdtr.kernels.bugs import GRAPH_ONLY, Bug
from kdtr.kernels.launch_types import CaptureError, RunOutput
from kdtr.kernels.registry import resolve_kernel, variant_name

KERNELS = Path(__file__).resolve().parent / "graph_kernels.py"


@pytest.fixture(scope="module")
def ci_paths():
    return find_bundles(["ci"])


@pytest.fixture(scope="module")
def graph_paths():
    return find_bundles(["graph"])


def _bf16(paths):
    return [p for p in paths if read_meta(p)["kv_dtype"] == "bf16"]


def _describe(rep):
    return [(r.case, r.status.value, r.message) for r in rep.results if r.status is not Status.PASS]


# ---- the proof on the suites ------------------------------------------------------------------------

def test_correct_emulation_passes_graph_on_ci_and_the_graph_suite(ci_paths, graph_paths):
    rep = run_verify(resolve_kernel("emulate-flash"), ci_paths + graph_paths, graph=True)
    assert not rep.failed and rep.graph and rep.to_json()["graph"] is True, _describe(rep)
    taken = [r for r in rep.results if r.status is not Status.SKIPPED]
    bf16 = [r for r in rep.results if r.shape["kv"] == "bf16"]  # emulate-flash takes bf16 storage only
    assert taken == bf16 and len(taken) >= len(ci_paths) // 2 + len(graph_paths), _describe(rep)
    for r in taken:
        assert r.status is Status.PASS and len(r.captures) >= 2, (r.case, r.captures)
        assert all(c.status is Status.PASS and {x.output for x in c.checks} == {"out", "lse"} for c in r.captures)
        assert all(c.ms is not None for c in r.captures)
    layouts = {c.layout for r in taken for c in r.captures}
    assert {f"P={f}" for f in FILLS} <= layouts  # ci's P = 2500 decode holds 1024 + T tokens
    sib = [r for r in taken if any(c.sibling for c in r.captures)]
    assert len(sib) == 6, [r.case for r in sib]  # the graph suite: every case but the first of its group


def test_baked_lengths_passes_plain_verify_and_fails_graph_on_every_ci_case(ci_paths):
    kernel = resolve_kernel(variant_name("emulate-flash", Bug.BAKED_LENGTHS))
    plain = run_verify(kernel, ci_paths)
    assert not plain.failed, _describe(plain)
    rep = run_verify(kernel, ci_paths, graph=True)
    taken = [r for r in rep.results if r.status is not Status.SKIPPED]
    failed = [r for r in taken if r.status.failed]
    assert rep.failed and failed == taken and len(taken) >= len(ci_paths) // 2, _describe(rep)
    for r in failed:
        assert r.status in (Status.FAIL_NUMERIC, Status.NAN), (r.case, r.status, r.message)
        assert all(c.status is Status.PASS for c in r.checks)  # the direct run is right
        assert r.message.startswith("captured at P=") and ", replayed at P=" in r.message, r.message


def test_baked_lengths_fails_graph_on_every_graph_suite_case(graph_paths):
    rep = run_verify(resolve_kernel("emulate-flash-bug=baked-lengths"), graph_paths, graph=True)
    assert len(rep.results) == 10 and all(r.status.failed for r in rep.results), _describe(rep)
    # where every length equals the capture's, the replay is right: the P = 0 request captured at P = 0
    p0 = next(r for r in rep.results if r.case == "dsv3-h2-p0-ddtree16m-pg1-cap160-bf16-s0")
    assert {c.layout: c.status for c in p0.captures}["P=0"] is Status.PASS
    assert any(c.sibling and c.status.failed for r in rep.results for c in r.captures)


@pytest.mark.parametrize("bug", GRAPH_ONLY, ids=lambda b: b.slug)
def test_every_graph_only_bug_fails_graph_in_isolated_children(graph_paths, bug):
    """Through the CLI's default path: each case in a child process, which gets its sibling's path."""
    paths = graph_paths[:4]
    rep = run_verify(resolve_kernel(variant_name("emulate-flash", bug)), paths, graph=True, isolate=True)
    assert rep.isolated and all(r.status.failed for r in rep.results), _describe(rep)
    good = run_verify(resolve_kernel("emulate-flash"), paths, graph=True, isolate=True)
    assert not good.failed, _describe(good)
    assert [bool(any(c.sibling for c in r.captures)) for r in good.results] == [False, True, False, True]
    assert good.results[1].captures[-1].sibling == str(paths[0].resolve())


# ---- capture layouts ----------------------------------------------------------------------------

def test_fill_layouts_keep_the_buffers_and_take_a_chain(ci_paths):
    b = load_bundle(next(p for p in ci_paths if "p1.130-ddtree16m" in p.name))
    p = b.problem
    cap = fill_problem(p, 1)
    cap.validate()
    assert cap.prefix_lens.tolist() == [1, 1] and cap.q is p.q and cap.block_table is p.block_table
    chain = trees.chain(p.T)
    assert (cap.tree_mask == chain.mask_words()[None]).all() and (cap.tree_parent[1] == chain.parent).all()
    width = p.block_table.shape[1] * p.page_size  # 3 pages of 64: 1024 + 17 tokens do not fit
    assert width < 1024 + p.T and fill_problem(p, 1024) is None
    assert [lay.label for lay in capture_layouts(b)] == ["P=0", "P=1"]


def test_siblings_are_the_previous_bundle_with_the_same_buffers(graph_paths, ci_paths):
    sib = siblings(graph_paths + ci_paths[:2])
    assert sib[0] is None and sib[1] == graph_paths[0] and sib[2] is None and sib[3] == graph_paths[2]
    assert sib[6] == graph_paths[5] and sib[7] == graph_paths[6]  # a chain of four: each on the previous
    assert sib[10:] == [None, None]
    a, b = read_meta(graph_paths[0]), read_meta(graph_paths[1])
    assert buffer_key(a) == buffer_key(b)
    assert buffer_key(a) != buffer_key({**b, "scale": b["scale"] * 2})  # another model: never the same graph
    assert buffer_key(a) != buffer_key({**b, "out_dtype": "fp32"})


def test_a_sibling_with_other_buffers_is_refused(graph_paths):
    one, other = load_bundle(graph_paths[0]), load_bundle(graph_paths[2])
    with pytest.raises(ValueError, match="does not share"):
        capture_layouts(one, other)


# ---- the mock capture freezes what the prepare step decided ------------------------------------------

def _bits(got) -> bytes:
    out, lse = (got.out, got.lse) if hasattr(got, "out") else got
    return out.tobytes() + lse.tobytes()


def test_the_mock_capture_freezes_the_plan(graph_paths):
    """A launch prepared on one problem and replayed on another computes with what it decided at capture
    (the baked lengths), and the correct one with the buffers' contents at replay: both bit for bit."""
    from kdtr.kernels.emulate import emulate_flash

    first, second = (load_bundle(p) for p in graph_paths[4:6])  # P = 100, then P = 0 (one request)
    out_dtype = second.out_dtype
    baked = resolve_kernel("emulate-flash-bug=baked-lengths").graph(first.problem, out_dtype)
    right = resolve_kernel("emulate-flash").graph(first.problem, out_dtype)
    for runner in (baked, right):
        runner.load(second.problem)
    got, want = baked.replay(), emulate_flash(replace(second.problem, prefix_lens=first.problem.prefix_lens), out_dtype)
    assert _bits(got) == _bits(want) and np.isnan(got.out).any()  # P = 100 reads slots the case left NaN
    got, want = right.replay(), emulate_flash(second.problem, out_dtype)
    assert _bits(got) == _bits(want) and not np.isnan(got.out).any()
    assert baked.buffers.prefix_lens.tolist() == [0]  # the buffers hold the case; the plan does not read them


def test_a_plan_decided_at_capture_is_what_a_replay_sees(graph_paths):
    from kdtr.kernels.emulate import HostBuffers, HostGraphRun, MockGraph

    a, b = (load_bundle(p) for p in graph_paths[:2])
    buffers = HostBuffers(a.problem, a.out_dtype)
    plan = {"P": buffers.prefix_lens.copy()}  # decided on the capture's buffers

    def launch():
        buffers.out[...] = plan["P"][:, None, None, None]
        buffers.lse[...] = buffers.prefix_lens[:, None, None]
        return None

    runner = HostGraphRun("probe", buffers, MockGraph(launch))
    runner.load(b.problem)
    got = runner.replay()
    assert (got.out[:, 0, 0, 0] == a.problem.prefix_lens).all() and (got.lse[:, 0, 0] == b.problem.prefix_lens).all()


def test_host_buffers_take_inputs_in_place_and_refuse_other_shapes(graph_paths, ci_paths):
    from kdtr.kernels.emulate import HostBuffers

    a, b = (load_bundle(p) for p in graph_paths[:2])
    buffers = HostBuffers(a.problem, a.out_dtype)
    q, lens = buffers.q, buffers.prefix_lens
    buffers.upload(b.problem)
    assert buffers.q is q and buffers.prefix_lens is lens and (lens == b.problem.prefix_lens).all()
    assert buffers.q.tobytes() == b.problem.q.tobytes()
    with pytest.raises(ValueError, match="^q: the buffers hold"):
        buffers.upload(load_bundle(ci_paths[0]).problem)
    buffers.poison()
    from kdtr.check.compare import poison_mask

    assert poison_mask(buffers.out).all() and poison_mask(buffers.lse).all()


# ---- statuses of a capture --------------------------------------------------------------------------

class _Fake:
    """emulate-flash with a graph that misbehaves as ``how`` says: "refuse" (CaptureError), "race" (each
    replay one ulp apart), "slow" (a replay reports 10x the direct time) or "none" (no graph method)."""

    def __init__(self, how: str):
        self.inner = resolve_kernel("emulate-flash")
        self.name, self.caps, self.writes_lse, self.how = f"fake-{how}", self.inner.caps, True, how
        if how != "none":
            self.graph = self._graph

    def run(self, problem, out_dtype):
        return self.inner.run(problem, out_dtype)

    def _graph(self, problem, out_dtype):
        if self.how == "refuse":
            raise CaptureError("the launch cannot be captured: cudaErrorStreamCaptureUnsupported")
        runner, fake = self.inner.graph(problem, out_dtype), self

        class Runner:
            calls = 0

            def load(self, p):
                runner.load(p)

            def replay(self):
                got = runner.replay()
                Runner.calls += 1
                if fake.how == "race" and Runner.calls % 2 == 0:
                    got.out.reshape(-1)[3] = np.nextafter(got.out.reshape(-1)[3], np.float32(np.inf))
                return RunOutput(got.out, got.lse, 1e4 if fake.how == "slow" else got.ms)

        return Runner()


@pytest.fixture(scope="module")
def small_bundle(graph_paths):
    return load_bundle(graph_paths[0])


def test_a_capture_that_raises_is_capture_error(small_bundle):
    res = verify_graph(_Fake("refuse"), small_bundle)
    assert res.status is Status.CAPTURE_ERROR and res.status.failed
    assert [c.status for c in res.captures] == [Status.CAPTURE_ERROR] * 2
    assert res.message.startswith("captured at P=0, replayed at P=0..63: CAPTURE_ERROR the launch cannot be captured")
    assert all(c.status is Status.PASS for c in res.checks)  # the direct run is fine


def test_replays_that_differ_are_a_race(small_bundle):
    res = verify_graph(_Fake("race"), small_bundle, repeat=3)
    assert res.status is Status.RACE and "differs bitwise from the first replay" in res.message


def test_a_slow_replay_is_a_warning_not_a_failure(small_bundle):
    res = verify_graph(_Fake("slow"), small_bundle)
    assert res.status is Status.PASS and len(res.warnings) == 2, res.warnings
    assert res.warnings[0].startswith("captured at P=0: replay 1e+04 ms, direct launch ") and "x)" in res.warnings[0]
    back = CaseResult.from_json(res.to_json())
    assert back.warnings == res.warnings and [c.to_json() for c in back.captures] == [c.to_json() for c in res.captures]


def test_a_kernel_without_graph_is_skipped_with_the_reason(small_bundle, graph_paths):
    res = verify_graph(_Fake("none"), small_bundle)
    assert res.status is Status.SKIPPED and "has no CUDA graph capture" in res.message
    rep = run_verify(_Fake("none"), graph_paths[:2], graph=True)
    assert rep.failed and rep.counts == {"SKIPPED": 2}  # nothing verified under --graph is no pass


def test_a_case_the_kernel_does_not_take_is_skipped_before_any_capture(ci_paths):
    fp32 = next(p for p in ci_paths if read_meta(p)["kv_dtype"] == "fp32")
    res = verify_graph(_Fake("refuse"), load_bundle(fp32))
    assert res.status is Status.SKIPPED and not res.captures


# ---- Python callables on the CPU ----------------------------------------------------------------------

def test_cpu_callables_go_through_the_mock_capture(graph_paths):
    right = run_verify(resolve_kernel(f"{KERNELS}:cpu_correct"), graph_paths[:4], graph=True)
    assert not right.failed and all(len(r.captures) >= 2 for r in right.results), _describe(right)
    baked = resolve_kernel(f"{KERNELS}:cpu_baked")
    assert not run_verify(baked, graph_paths[:4]).failed  # fresh arrays every plain run: right
    rep = run_verify(baked, graph_paths[:4], graph=True)
    assert all(r.status.failed for r in rep.results), _describe(rep)


def test_sglang_layout_callables_are_skipped_under_graph(graph_paths):
    from conftest import ROOT

    spec = f"{ROOT / 'tests' / 'adapters' / 'sglang_kernels.py'}:attend"
    rep = run_verify(resolve_kernel(spec), graph_paths[4:5], graph=True)
    (r,) = rep.results
    assert r.status is Status.SKIPPED and "SGLang tensors" in r.message and r.checks[0].status is Status.PASS


def test_the_graph_suite_is_what_its_docstring_says():
    specs = suites.graph()
    assert "graph" in suites.COMMITTED and all(s.capacity for s in specs)
    assert {s.B for s in specs} >= {1, 8} and {s.page_size for s in specs} >= {1, 64}
    assert 1 in {s.T for s in specs} and any(s.T >= 17 for s in specs) and any(s.T % 32 == 0 for s in specs)
    assert sum(s.kv_dtype == "bf16" for s in specs) == len(specs)
    assert any(0 in s.prefix_lens and s.B == 1 for s in specs)
    groups = {}
    for s in specs:  # a group is contiguous: its cases follow each other
        key = (s.B, s.T, s.H, s.page_size, s.capacity, s.kv_dtype, s.out_dtype, s.model)
        assert key not in groups or groups[key] == len(groups) - 1 or list(groups)[-1] == key
        groups.setdefault(key, len(groups))
    assert len(groups) == 4 and len(specs) == 10
    assert sum(s.nbytes_estimate() for s in specs) < 7e6


def test_an_isolated_graph_case_gets_time_for_every_replay():
    from kdtr.check import isolate

    assert isolate.runs(1, False, False) == 1 and isolate.runs(3, False, True) == 1
    assert isolate.runs(1, True, False) == 1 + (len(FILLS) + 1) * 2 and isolate.runs(3, True, False) == 3 + 4 * 3
    assert isolate.default_timeout(10**12, 0, isolate.runs(1, True, True), sanitize=True) > \
        isolate.default_timeout(10**12, 0, 1, sanitize=True)
