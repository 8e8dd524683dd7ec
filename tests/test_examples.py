"""The README's "Write and verify your own kernel" examples (docs/examples/) run as the README says:
the Python one passes committed goldens on the CPU through ``-k path/to/file.py:fn``, the CUDA one
compiles for every portable arch without spills (NVRTC, no GPU) and passes ci on a GPU."""

from __future__ import annotations

import json

import pytest

from conftest import GOLDENS_CI, ROOT

EXAMPLES = ROOT / "docs" / "examples"
CUDA_SPEC = f"{EXAMPLES / 'my_verify.cu'}:my_verify<{{kv}}, {{out}}>"
SOME_CI = ["kimi-h2-p31.130-ddtree3u-pg64-bf16-s0", "kimi-h8-p0.1.63.64.65-root-pg1-fp32-s0",
           "dsv3-h2-p1-ddtree64m-pg1-fp32obf16-s0"]
"""A tree over a mixed batch, decode over prefix edges on 1-token pages, fp32 storage with bf16 out."""


def test_python_example_passes_committed_goldens_on_the_cpu(kdtr):
    r = kdtr("verify", "-k", f"{EXAMPLES / 'my_verify.py'}:verify", "--no-isolate", "--json", "-",
             *[GOLDENS_CI / f"{n}.kdtr" for n in SOME_CI])
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    assert rep["counts"] == {"PASS": len(SOME_CI)}, rep["counts"]


@pytest.mark.nvrtc
@pytest.mark.parametrize("arch", ["sm_80", "sm_86", "sm_89", "sm_90", "sm_120"])
def test_cuda_example_compiles_without_spills(arch):
    from kdtr.kernels import nvrtc
    from kdtr.kernels.launch_types import CTYPES

    exprs = [f"my_verify<{CTYPES[kv]}, {CTYPES[o]}>" for kv in ("fp32", "bf16") for o in ("fp32", "bf16")]
    built = nvrtc.compile_file(EXAMPLES / "my_verify.cu", exprs, arch)
    for e in exprs:
        res = built.resource(e)
        assert res.spill_stores == 0 and res.spill_loads == 0, (arch, e, res)


@pytest.mark.gpu
def test_cuda_example_passes_ci_on_a_gpu(kdtr):
    r = kdtr("verify", "-k", CUDA_SPEC, "ci")
    assert r.exit_code == 0, r.output
