"""Crash and hang isolation on a CPU: each case in a child process (kdtr.isolate).

CPU Python-callable kernels (tests/kernels_for_tests.py) fault on the bigger of two bundles; the
fault becomes that case's status (RUNTIME_ERROR / TIMEOUT), the other case still PASSes, and
the CLI exits 1. The GPU versions (illegal address, trap, hang, compute-sanitizer) are in
tests/check/test_gpu_isolation.py.
"""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from kdtr.check import isolate
from kdtr.kernels import nvrtc
from kdtr.cli import main
from kdtr.check.compare import Status
from kdtr.kernels.registry import resolve_kernel
from kdtr.check.case import CaseResult
from kdtr.golden.store import find_bundles
from kdtr.check.suite import run_verify

K = "kernels_for_tests:"


@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    """Two small bf16 bundles: T = 5 (small: every test kernel behaves) and T = 17 (big: faults)."""
    out = tmp_path_factory.mktemp("iso")
    r = CliRunner().invoke(main, ["gen", "--model", "kimi-k2", "--heads", "2", "--prefix", "3,70", "--budget", "4,16",
                                  "--out", str(out), "--json"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    return sorted(out.glob("*.kdtr"))


def verify(tmp_path, *args):
    """(exit code, {T: result}, report) of `kdtr verify ARGS --json`."""
    rep_path = tmp_path / f"rep{time.monotonic_ns()}.json"
    r = CliRunner().invoke(main, ["verify", *map(str, args), "--json", str(rep_path)])
    assert rep_path.exists(), r.output
    rep = json.loads(rep_path.read_text())
    return r.exit_code, {res["shape"]["T"]: res for res in rep["results"]}, rep


@pytest.mark.parametrize("mode", [[], ["--no-isolate"]], ids=["isolated", "in-process"])
@pytest.mark.parametrize("kernel", [K + "correct", "emulate-flash"])
def test_cpu_kernels_pass_in_both_modes(tmp_path, bundles, kernel, mode):
    code, by_t, rep = verify(tmp_path, "-k", kernel, *bundles, *mode)
    assert code == 0 and rep["counts"] == {"PASS": 2}, by_t
    assert rep["isolated"] is (not mode)
    assert all({c["output"] for c in r["checks"]} == {"out", "lse"} for r in by_t.values())


@pytest.mark.parametrize("kernel,fragment", [
    ("abort_on_big", "child process died with signal 6 (SIGABRT)"),
    ("exit3_on_big", "child process exited with code 3"),
    ("segv_on_big", "child process died with signal 11 (SIGSEGV)"),
    ("raise_on_big", "RuntimeError: planted failure in a Python kernel"),
])
def test_a_crashing_kernel_fails_only_its_case(tmp_path, bundles, kernel, fragment):
    code, by_t, rep = verify(tmp_path, "-k", K + kernel, *bundles)
    assert code == 1
    assert by_t[5]["status"] == "PASS", by_t[5]["message"]
    assert by_t[17]["status"] == "RUNTIME_ERROR" and fragment in by_t[17]["message"], by_t[17]["message"]
    assert by_t[17]["shape"]["H"] == 2 and by_t[17]["case"] and by_t[17]["path"]  # the parent fills these in


def test_a_hanging_kernel_is_killed_with_timeout(tmp_path, bundles, monkeypatch):
    pidfile = tmp_path / "hang.pid"
    monkeypatch.setenv("KDTR_TEST_PIDFILE", str(pidfile))
    t0 = time.monotonic()
    code, by_t, _ = verify(tmp_path, "-k", K + "hang_on_big", *bundles, "--timeout", "6")
    assert code == 1 and time.monotonic() - t0 < 40
    assert by_t[5]["status"] == "PASS", by_t[5]["message"]
    assert by_t[17]["status"] == "TIMEOUT" and "no result within 6 s" in by_t[17]["message"]
    with pytest.raises(ProcessLookupError):  # the hung child is gone, not left running
        os.kill(int(pidfile.read_text()), 0)


def test_library_api_isolated_and_json_round_trip(bundles):
    kern = resolve_kernel(K + "segv_on_big")
    rep = run_verify(kern, bundles, isolate=True, timeout=60)
    assert {r.shape["T"]: r.status for r in rep.results} == {5: Status.PASS, 17: Status.RUNTIME_ERROR} and rep.isolated
    for r in rep.results:
        back = CaseResult.from_json(json.loads(json.dumps(r.to_json())))
        assert back.to_json() == r.to_json()


def test_skipped_cases_are_decided_without_a_child(tmp_path, monkeypatch):
    r = CliRunner().invoke(main, ["gen", "--prefix", "5", "--budget", "4", "--kv-dtype", "fp32", "--out", str(tmp_path)])
    assert r.exit_code == 0, r.output
    monkeypatch.setattr(isolate, "_run", lambda *a: pytest.fail("spawned a child for a skipped case"))
    rep = run_verify(resolve_kernel("emulate-flash"), find_bundles([str(tmp_path)]), isolate=True)
    assert rep.results[0].status is Status.SKIPPED and "fp32" in rep.results[0].message


def test_default_timeout_grows_with_work_and_is_generous():
    small = isolate.default_timeout(10**6, 10**5)
    assert 60 <= small < 61
    assert isolate.default_timeout(10**12, 10**5) > small + 90  # 1 TFLOP: ~100 s more on a GPU
    assert isolate.default_timeout(10**12, 10**5, gpu=False) > isolate.default_timeout(10**12, 10**5)
    assert isolate.default_timeout(10**12, 10**5, repeat=3) > isolate.default_timeout(10**12, 10**5)
    assert isolate.default_timeout(10**6, 10**5, sanitize=True) >= 300


def test_force_is_accepted(tmp_path, bundles):
    code, _, rep = verify(tmp_path, "-k", "emulate-flash", "--force", "--no-isolate", bundles[0])
    assert code == 0 and rep["counts"] == {"PASS": 1}
    assert find_bundles([str(bundles[0])], force=True) == [bundles[0]]


# ---- --sanitize --------------------------------------------------------------------------------


def one_line_error(args, fragment):
    r = CliRunner().invoke(main, args)
    text = r.output.strip()
    assert r.exit_code == 2, (r.exit_code, text)
    assert fragment in text and "Traceback" not in text and len(text.splitlines()) == 1, text


def test_sanitize_without_compute_sanitizer_is_a_one_line_error(bundles, monkeypatch):
    monkeypatch.setenv("PATH", "")
    for var in ("KDTR_SANITIZER", "CUDA_HOME", "CUDA_PATH"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(isolate, "SEARCH_GLOBS", ())
    monkeypatch.setattr(isolate, "_pip_sanitizers", lambda: [])
    assert isolate.find_sanitizer() is None
    one_line_error(["verify", "-k", "emulate-flash", "--sanitize", "memcheck", str(bundles[0])], "compute-sanitizer")


@pytest.mark.parametrize("args,fragment", [
    (["--sanitize", "memcheck", "--no-isolate"], "drop --no-isolate"),
    (["--timeout", "5", "--no-isolate"], "drop --no-isolate"),
    (["--timeout", "0"], "--timeout must be"),
])
def test_bad_isolation_options_are_one_line_errors(bundles, args, fragment):
    one_line_error(["verify", "-k", "emulate-flash", *args, str(bundles[0])], fragment)


def test_unknown_sanitizer_tool_is_a_usage_error(bundles):
    r = CliRunner().invoke(main, ["verify", "-k", "emulate-flash", "--sanitize", "leakcheck", str(bundles[0])])
    assert r.exit_code == 2 and "leakcheck" in r.output and "Traceback" not in r.output


FAKE_SANITIZER = """#!/bin/sh
# A stand-in for compute-sanitizer: records its options, runs the target, and with
# FAKE_FINDING set reports one finding and exits with the --error-exitcode value.
echo "$@" >> "$FAKE_ARGS"
echo "lineinfo=$KDTR_LINEINFO" >> "$FAKE_ARGS.env"
while [ "${1#--}" != "$1" ]; do shift 2; done
echo "========= COMPUTE-SANITIZER"
"$@"
rc=$?
if [ -n "$FAKE_FINDING" ]; then
  echo "========= Invalid __global__ read of size 2 bytes"
  echo "=========     at fake_kernel+0x10 in fake.cu:3"
  echo "=========     Host Frame: somewhere"
  echo "========= ERROR SUMMARY: 1 error"
  exit 99
fi
echo "========= ERROR SUMMARY: 0 errors"
exit $rc
"""


@pytest.mark.parametrize("finding", [False, True])
def test_sanitize_runs_each_child_under_the_sanitizer(tmp_path, bundles, monkeypatch, finding):
    exe = tmp_path / "bin" / "compute-sanitizer"
    exe.parent.mkdir()
    exe.write_text(FAKE_SANITIZER)
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{exe.parent}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.delenv("KDTR_SANITIZER", raising=False)
    monkeypatch.setenv("FAKE_ARGS", str(tmp_path / "args.txt"))
    monkeypatch.setenv("FAKE_FINDING", "1" if finding else "")
    code, by_t, rep = verify(tmp_path, "-k", K + "correct", "--sanitize", "memcheck", "--repeat", "3", *bundles)
    calls = (tmp_path / "args.txt").read_text().splitlines()
    assert len(calls) == 2 and all(c.startswith("--tool memcheck --error-exitcode 99") for c in calls)
    # sanitized children compile with -lineinfo, so a report names .cu lines
    assert (tmp_path / "args.txt.env").read_text().splitlines() == ["lineinfo=1"] * 2
    assert rep["sanitizer"] == "memcheck" and rep["isolated"]
    if not finding:
        assert code == 0 and rep["counts"] == {"PASS": 2}
    else:
        assert code == 1 and rep["counts"] == {"SANITIZER": 2}
        msg = by_t[5]["message"]
        assert msg.startswith("Invalid __global__ read of size 2 bytes | at fake_kernel+0x10") and "Host Frame" not in msg
        assert msg.endswith("ERROR SUMMARY: 1 error") and by_t[5]["checks"]  # the child's own checks are kept


def test_sanitizer_findings_text():
    log = ("========= COMPUTE-SANITIZER\nhello from the app\n========= Error: Race reported between Write access at k+0x10\n"
           "=========     and Read access at k+0x20 [12 hazards]\n=========\n"
           "========= RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)\n")
    assert isolate.findings(log) == ("Error: Race reported between Write access at k+0x10 | and Read access at k+0x20 "
                                     "[12 hazards] | RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)")


# ---- the GPU fault kernels of tests/check/test_gpu_isolation.py.compile (NVRTC needs no GPU) --------------


@pytest.mark.nvrtc
@pytest.mark.parametrize("name,expr", [
    ("oob_write", "kdtr_test_oob_write"), ("trap", "kdtr_test_trap"), ("hang", "kdtr_test_hang"),
    ("oob_read", "kdtr_test_oob_read<__nv_bfloat16, __nv_bfloat16>"), ("oob_read", "kdtr_test_oob_read<float, float>"),
])
def test_gpu_fault_kernels_compile(name, expr):
    c = nvrtc.compile_file(Path(__file__).resolve().parents[1] / "cuda" / f"{name}.cu", [expr], "sm_90", cache=False)
    assert c.cubin[:4] == b"\x7fELF" and not c.warnings
