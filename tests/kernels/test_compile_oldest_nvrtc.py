"""Every shipped build also compiles with the oldest NVRTC kdtr allows (pyproject: nvidia-cuda-nvrtc >= 13.0;
13.0 is also what the lent GPUs run), not only with the newest one pip gives CI.

NVRTC 13.0 rejects code that 13.5 compiles: a generic lambda in a kernel is host code to it. `make test`
downloads that wheel beside the venv (Makefile, NVRTC_MIN); each compile runs in a child process whose
library path puts it first, so the two NVRTCs never share a process. Spills are not judged here: 13.0
spills 16 B in the transposed-rows builds that 13.5 builds clean (docs/PERF.md, Resource report).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kdtr.kernels import nvrtc, registry
from kdtr.kernels.bugs import Bug

from conftest import TEST_CUDA

OLDEST = sorted(Path(sys.prefix).glob("nvrtc-13.0.*"))
"""The unpacked wheel `make test` put beside the venv (sys.prefix), if any."""

CHILD = r"""
import json, sys
from pathlib import Path
from kdtr.kernels import nvrtc
nvrtc.use_library(sys.argv[1])  # this NVRTC, with the headers kdtr already uses
src, names, arch = sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
out = {"version": list(nvrtc.version()), "error": None}
try:
    nvrtc.compile_file(Path(src), names, arch, cache=False)
except nvrtc.CompileError as e:
    out["error"] = str(e)
print(json.dumps(out))
"""


def compile_with_oldest(src: Path, names: list[str], arch: str) -> dict:
    """Compile in a child process with the oldest NVRTC loaded: {"version": [13, 0], "error": None or text}."""
    lib = OLDEST[-1] / "nvidia" / "cu13" / "lib" / "libnvrtc.so.13"
    env = dict(os.environ, LD_LIBRARY_PATH=os.pathsep.join([str(lib.parent), os.environ.get("LD_LIBRARY_PATH", "")]))
    run = subprocess.run([sys.executable, "-c", CHILD, str(lib), str(src), json.dumps(names), arch],
                         capture_output=True, text=True, env=env, timeout=1500)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


needs_oldest = pytest.mark.skipif(not OLDEST, reason="NVRTC 13.0 not unpacked beside the venv (make test does it)")
JOBS = [(src, names, arch) for src, names, archs in registry.compile_targets((Bug.NONE,)) for arch in archs]


@pytest.fixture(scope="module")
def oldest_results():
    with ThreadPoolExecutor(max_workers=min(len(JOBS), os.cpu_count() or 1)) as pool:
        return dict(zip([(str(s), a) for s, _, a in JOBS], pool.map(lambda j: compile_with_oldest(*j), JOBS)))


@pytest.mark.nvrtc
@needs_oldest
@pytest.mark.parametrize("src,names,arch", JOBS, ids=[f"{s.name}-{a}" for s, _, a in JOBS])
def test_shipped_builds_compile_with_the_oldest_nvrtc(oldest_results, src, names, arch):
    got = oldest_results[(str(src), arch)]
    assert got["version"][:2] == [13, 0], got
    assert got["error"] is None, f"{src.name} for {arch} does not compile with NVRTC 13.0:\n{got['error'][:3000]}"


@pytest.mark.nvrtc
@needs_oldest
def test_the_oldest_nvrtc_check_fails_on_code_only_newer_nvrtc_takes():
    """The planted generic lambda: rejected by 13.0 (so the check above can fail), and compiled by the newer
    NVRTC the rest of the tests use, where there is one (so it is the version that differs, not the code)."""
    src = TEST_CUDA / "generic_lambda.cu"
    got = compile_with_oldest(src, ["kdtr_test_generic_lambda"], "sm_80")
    assert got["error"] and "host function" in got["error"], got
    if nvrtc.version() > (13, 0):
        nvrtc.compile_file(src, ["kdtr_test_generic_lambda"], "sm_80", cache=False)
