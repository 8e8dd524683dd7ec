"""The proof that a kdtr PASS means something: every planted bug FAILs on the ci suite.

Runs the whole verify pipeline (bundles -> kernel -> compare -> status) with the CPU
emulation of the bf16 flash kernel, so it runs in CI without a GPU. The same proof for the
CUDA kernels is in tests/test_gpu_verify.py.
"""

import pytest

from kdtr.kernels.bugs import PLANTED, Bug
from kdtr.check.compare import Status
from kdtr.kernels.registry import resolve_kernel, variant_name
from kdtr.golden.store import find_bundles
from kdtr.check.suite import run_verify


@pytest.fixture(scope="module")
def ci_paths():
    return find_bundles(["ci"])


def test_correct_emulation_passes_every_bf16_bundle(ci_paths):
    rep = run_verify(resolve_kernel("emulate-flash"), ci_paths)
    by = {r.case: r for r in rep.results}
    assert not rep.failed, [(r.case, r.status, r.message) for r in rep.results if r.status.failed]
    for r in rep.results:
        if r.shape["kv"] == "fp32":
            assert r.status is Status.SKIPPED and "fp32" in r.message
        else:
            assert r.status is Status.PASS and {c.output for c in r.checks} == {"out", "lse"}
    assert sum(r.status is Status.PASS for r in by.values()) >= 10


@pytest.mark.parametrize("bug", PLANTED, ids=lambda b: b.slug)
def test_every_planted_bug_fails_the_ci_suite(ci_paths, bug: Bug):
    rep = run_verify(resolve_kernel(variant_name("emulate-flash", bug)), ci_paths)
    failed = [r for r in rep.results if r.status.failed]
    assert failed, f"{bug.slug} passed the whole ci suite: kdtr would not catch it"
    assert rep.failed
    for r in failed:
        assert r.status in (Status.FAIL_NUMERIC, Status.NAN), (r.case, r.status, r.message)
    if bug is Bug.SIBLING_VISIBLE:  # a mask bug shows up as whole tree nodes failing
        assert any(c.bad_nodes for r in failed for c in r.checks)


def test_repeat_of_a_deterministic_kernel_is_not_a_race(ci_paths):
    rep = run_verify(resolve_kernel("emulate-flash"), ci_paths[:3], repeat=2)
    assert all(r.status is not Status.RACE for r in rep.results)


class _Flaky:
    """emulate-flash whose second run differs in one element by one ulp: a race in miniature."""

    def __init__(self):
        self.inner = resolve_kernel("emulate-flash")
        self.name, self.caps, self.writes_lse, self.calls = "flaky", self.inner.caps, True, 0

    def run(self, problem, out_dtype):
        import numpy as np

        res = self.inner.run(problem, out_dtype)
        self.calls += 1
        if self.calls % 2 == 0:
            res.out.reshape(-1)[7] = np.nextafter(res.out.reshape(-1)[7], np.float32(np.inf))
        return res


def test_repeat_catches_a_run_that_differs_bitwise(ci_paths):
    bf16 = [p for p in ci_paths if "bf16" in p.name and "fp32" not in p.name][:1]
    rep = run_verify(_Flaky(), bf16, repeat=3)
    assert rep.results[0].status is Status.RACE and "differs bitwise" in rep.results[0].message
    assert rep.failed
