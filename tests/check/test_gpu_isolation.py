"""On a GPU: a kernel that faults or hangs fails only its own cases, in child processes, and
leaves this process's CUDA context usable; compute-sanitizer finds a planted out-of-bounds read
and nothing in the built-in kernels.

The faulty kernels are tests/cuda/*.cu (kdtr_abi.h contract). The CPU-side checks of the same
machinery (signals, exit codes, timeouts, the sanitizer plumbing) are in tests/check/test_isolate.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from kdtr.check import isolate
from kdtr.cli import main
from kdtr.kernels.launch import device_arch

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
GOLDENS = ROOT / "goldens" / "ci"
CUDA = Path(__file__).resolve().parents[1] / "cuda"
FAULT_BUNDLES = [GOLDENS / "kimi-h4-p0.100-chain16-pg64-bf16-s0.kdtr", GOLDENS / "dsv3-h2-p1-ddtree64m-pg1-fp32obf16-s0.kdtr"]
"""Two small ci goldens (bf16 and fp32 storage): the faulty kernels take any dtype."""
SANITIZE_BUNDLES = [GOLDENS / "kimi-h4-p0.100-chain16-pg64-bf16-s0.kdtr", GOLDENS / "kimi-h4-p64-star16-pg1-bf16-s0.kdtr",
                    GOLDENS / "dsv3-h16-p1.130-ddtree16m-pg64-bf16-s0.kdtr",
                    GOLDENS / "kimi-h8-p0.1.33.64.65.300-root-pg64-bf16-s0.kdtr",
                    GOLDENS / "kimi-h2-p31.130-ddtree3u-pg64-bf16-s0.kdtr"]
"""Five small bf16 ci goldens (flash takes bf16 only): page sizes 64 and 1, a chain, a star, DDTrees, and
two of 8 rows (flash-sm90 runs them with every row transposed, merged by the narrow combine)."""


def verify(tmp_path, *args):
    """(exit code, report dict, output) of `kdtr verify ARGS --json`, in this process."""
    rep_path = tmp_path / f"rep{time.monotonic_ns()}.json"
    r = CliRunner().invoke(main, ["verify", *map(str, args), "--json", str(rep_path)])
    assert rep_path.exists(), r.output
    return r.exit_code, json.loads(rep_path.read_text()), r.output


def describe(rep):
    return [(r["case"], r["status"], r["message"]) for r in rep["results"]]


def naive_passes_here(tmp_path):
    """`kdtr verify -k naive --no-isolate`: the kernel runs in this process's CUDA context."""
    code, rep, out = verify(tmp_path, "-k", "naive", "--no-isolate", FAULT_BUNDLES[0])
    assert code == 0 and rep["counts"] == {"PASS": 1}, (describe(rep), out)


@pytest.mark.parametrize("kernel,status,extra", [
    ("oob_write.cu:kdtr_test_oob_write", "RUNTIME_ERROR", []),
    ("trap.cu:kdtr_test_trap", "RUNTIME_ERROR", []),
    ("hang.cu:kdtr_test_hang", "TIMEOUT", ["--timeout", "20"]),
], ids=["oob-write", "trap", "hang"])
def test_faulting_kernel_is_a_status_and_leaves_this_process_usable(tmp_path, kernel, status, extra):
    naive_passes_here(tmp_path)  # this process holds a live CUDA context before the faults
    code, rep, out = verify(tmp_path, "-k", CUDA / kernel, *FAULT_BUNDLES, *extra)
    print(describe(rep))  # the CUDA error text each child reported (pytest -s shows it)
    assert code == 1, out
    assert [r["status"] for r in rep["results"]] == [status] * len(FAULT_BUNDLES), describe(rep)
    assert all(r["message"] for r in rep["results"])
    if "oob_write" in kernel:
        assert all("illegal" in r["message"].lower() for r in rep["results"]), describe(rep)
    naive_passes_here(tmp_path)  # the faults happened in children: this context is not poisoned


@pytest.fixture(scope="module")
def sanitizer_works():
    """Skip where compute-sanitizer cannot instrument this device (e.g. under gVisor it answers
    "Device not supported"): probed once on a one-element cupy allocation."""
    cmd = isolate.sanitizer_command("memcheck") + [
        sys.executable, "-c", "import cupy; cupy.zeros(1).sum(); cupy.cuda.runtime.deviceSynchronize()"]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        pytest.skip("compute-sanitizer probe did not finish in 300 s")
    text = (p.stdout + p.stderr).strip()
    if p.returncode != 0 or "not supported" in text.lower():
        pytest.skip(f"compute-sanitizer does not run here (exit {p.returncode}): {' | '.join(text.splitlines()[:4])}")


@pytest.mark.sanitizer
@pytest.mark.usefixtures("sanitizer_works")
@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
@pytest.mark.parametrize("kernel", ["naive", "flash", "flash-sm90"])
def test_builtin_kernels_are_clean_under_the_sanitizer(tmp_path, kernel, tool):
    if kernel == "flash-sm90" and device_arch() != "sm_90":
        pytest.skip(f"flash-sm90 needs an sm_90 GPU; this one is {device_arch()}")
    code, rep, out = verify(tmp_path, "-k", kernel, "--sanitize", tool, *SANITIZE_BUNDLES)
    assert code == 0 and rep["counts"] == {"PASS": len(SANITIZE_BUNDLES)}, (describe(rep), out)


FLASH_SM90_FORCED = {
    "transposed-rows": "flash-sm90[xr=1]",
    "work-table": "flash-sm90[xr=0,segments=3]",  # pieces of <= 3 tiles
}
"""flash-sm90 paths ci's own plans rarely take, forced for the sanitizer runs (the child processes resolve
the kernel again from its name, suffix included)."""


@pytest.mark.sanitizer
@pytest.mark.usefixtures("sanitizer_works")
@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
@pytest.mark.parametrize("path", sorted(FLASH_SM90_FORCED))
def test_flash_sm90_forced_paths_are_clean_under_the_sanitizer(tmp_path, tool, path):
    """The two 68-row bundles (and, for transposed rows, the two 8-row ones: every row transposed) with
    flash-sm90's transposed rows, or its work table, forced on: clean under memcheck and racecheck."""
    if device_arch() != "sm_90":
        pytest.skip(f"flash-sm90 needs an sm_90 GPU; this one is {device_arch()}")
    bundles = SANITIZE_BUNDLES[:2] + (SANITIZE_BUNDLES[3:] if path == "transposed-rows" else [])
    code, rep, out = verify(tmp_path, "-k", FLASH_SM90_FORCED[path], "--sanitize", tool, *bundles)
    assert code == 0 and rep["counts"] == {"PASS": len(bundles)}, (describe(rep), out)


PLANTED_FOR_THE_SANITIZER = {
    "memcheck": ("oob_read.cu:kdtr_test_oob_read", "Invalid __global__ read"),
    "racecheck": ("smem_race.cu:kdtr_test_smem_race", "smem_race.cu:15"),
}
"""Per tool, a kernel with a bug only that tool sees and what its report must name: a read past an allocation
(memcheck); a warp reading shared memory another warp wrote with nothing between, the planted read on line 15
(racecheck), so that flash-sm90's clean racecheck above means its hand-offs are followed."""


@pytest.mark.sanitizer
@pytest.mark.usefixtures("sanitizer_works")
@pytest.mark.parametrize("tool", sorted(PLANTED_FOR_THE_SANITIZER))
def test_the_sanitizer_catches_its_planted_bug(tmp_path, tool):
    kernel, named = PLANTED_FOR_THE_SANITIZER[tool]
    spec = f"{CUDA / kernel}<{{kv}}, {{out}}>"
    code, rep, out = verify(tmp_path, "-k", spec, "--sanitize", tool, FAULT_BUNDLES[0])
    print(describe(rep))
    assert code == 1, out
    r = rep["results"][0]
    assert r["status"] == "SANITIZER" and named in r["message"], describe(rep)
