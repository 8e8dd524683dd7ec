"""The proof that a kdtr PASS means something: every planted bug FAILs on the ci suite.

Runs the whole verify pipeline (bundles -> kernel -> compare -> status) with the CPU
emulation of the bf16 flash kernel, so it runs in CI without a GPU. The same proof for the
CUDA kernels is in tests/test_gpu_verify.py.
"""

import pytest

from kdtr.kernels.bugs import PLAIN, Bug
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


@pytest.mark.parametrize("bug", PLAIN, ids=lambda b: b.slug)
def test_every_planted_bug_fails_the_ci_suite(ci_paths, bug: Bug):
    rep = run_verify(resolve_kernel(variant_name("emulate-flash", bug)), ci_paths)
    failed = [r for r in rep.results if r.status.failed]
    assert failed, f"{bug.slug} passed the whole ci suite: kdtr would not catch it"
    assert rep.failed
    for r in failed:
        assert r.status in (Status.FAIL_NUMERIC, Status.NAN), (r.case, r.status, r.message)
    if bug in MASK_BUGS:  # a mask bug shows up as whole tree nodes failing
        assert any(c.bad_nodes for r in failed for c in r.checks)


MASK_BUGS = (Bug.SIBLING_VISIBLE, Bug.MASK_STRIDE, Bug.MASK_BIT_ORDER, Bug.CAUSAL_MASK, Bug.MASK_REQUEST0, Bug.NO_SELF)
"""The planted tree-mask bugs."""


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


# ---- the device a report names ----------------------------------------------------------------

GPU_INFO = {"name": "NVIDIA H200", "cc": "sm_90", "sm_count": 132, "driver_version": 13000, "runtime_version": 13000,
            "nvrtc_version": "13.0", "cupy_version": "14.2.0"}


class _OnGpu:
    """The CPU emulation posing as a GPU kernel (caps.needs_gpu), for the report's device without a GPU."""

    def __init__(self):
        from dataclasses import replace

        self.inner = resolve_kernel("emulate-flash")
        self.name, self.writes_lse, self.caps = "on-gpu", True, replace(self.inner.caps, needs_gpu=True)

    def run(self, problem, out_dtype):
        return self.inner.run(problem, out_dtype)


def test_a_cpu_kernel_reports_cpu_and_its_versions_without_asking_the_gpu(small_dir, monkeypatch):
    import platform

    import numpy as np

    from kdtr.kernels import launch

    monkeypatch.setattr(launch, "device_info", lambda: pytest.fail("asked the GPU for a CPU kernel"))
    rep = run_verify(resolve_kernel("emulate-flash"), find_bundles([str(small_dir)]))
    assert rep.device == f"cpu, Python {platform.python_version()}, numpy {np.__version__}"
    d = rep.to_json()
    assert d["device"] == rep.device and d["device_info"]["kind"] == "cpu"
    assert d["device_info"]["numpy_version"] == np.__version__


@pytest.mark.parametrize("driver,line", [
    ("580.159", "NVIDIA H200 sm_90, driver 580.159, NVRTC 13.0, cupy 14.2.0"),
    (None, "NVIDIA H200 sm_90, CUDA driver 13.0, NVRTC 13.0, cupy 14.2.0"),  # no /proc/driver/nvidia here
])
def test_a_gpu_kernel_reports_the_gpu(small_dir, monkeypatch, driver, line):
    from kdtr.check import suite
    from kdtr.kernels import launch

    monkeypatch.setattr(launch, "gpu_available", lambda: True)
    monkeypatch.setattr(launch, "device_info", lambda: dict(GPU_INFO))
    monkeypatch.setattr(suite, "_nvidia_driver", lambda: driver)
    rep = run_verify(_OnGpu(), find_bundles([str(small_dir)]))
    assert rep.device == line and rep.device_info["kind"] == "cuda" and rep.device_info["sm_count"] == 132
    assert rep.device_info.get("nvidia_driver") == driver


def test_a_gpu_kernel_that_ran_nothing_names_no_gpu(small_dir, monkeypatch):
    from kdtr.kernels import launch

    monkeypatch.setattr(launch, "gpu_available", lambda: False)  # every case SKIPPED: needs a GPU
    monkeypatch.setattr(launch, "device_info", lambda: pytest.fail("asked the GPU though no case ran"))
    rep = run_verify(_OnGpu(), find_bundles([str(small_dir)]))
    assert all(r.status is Status.SKIPPED for r in rep.results)
    assert rep.device == "GPU kernel, no case ran" and rep.device_info == {"kind": "cuda", "ran": False}


def test_nvidia_driver_version_is_read_from_proc(tmp_path):
    from kdtr.check.suite import _nvidia_driver

    for text, want in [
        ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159  Release Build  (dvs-builder@U16)\n",
         "580.159"),
        ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024\n", "550.54.15"),
    ]:
        (tmp_path / "version").write_text(text)
        assert _nvidia_driver(str(tmp_path / "version")) == want
    assert _nvidia_driver(str(tmp_path / "missing")) is None


def test_the_table_title_names_the_device(kdtr, small_dir, capsys):
    from kdtr.cli.verify import render_verify

    r = kdtr("verify", "-k", "emulate-flash", small_dir)
    assert r.exit_code == 0 and r.stdout.splitlines()[1].startswith("on cpu, Python "), r.stdout
    rep = run_verify(resolve_kernel("emulate-flash"), find_bundles([str(small_dir)]))
    render_verify({**rep.to_json(), "device": GPU_INFO["name"] + " sm_90, driver 580.159"})
    assert capsys.readouterr().out.splitlines()[1].strip() == "on NVIDIA H200 sm_90, driver 580.159"
