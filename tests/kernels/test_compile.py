"""Every built-in CUDA kernel variant compiles through NVRTC for sm_80 / sm_90 / sm_120 (flash-sm90:
sm_90a, the only target with wgmma).

No GPU needed: NVRTC from pip compiles for any arch. Fails on any error or warning, on any
local-memory spill and on stack-frame growth; skipped only where NVRTC itself is unavailable.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from kdtr.kernels import registry as kernels, nvrtc


ALLOWED_WARNINGS: tuple[str, ...] = ()
"""Substrings of compiler warnings tolerated, each with a comment saying why (none today)."""
MAX_STACK_FRAME = {"kdtr_naive_verify": 0}
"""Measured stack frame per kernel family (bytes): growth means local memory crept in."""


TARGETS = kernels.compile_targets()
JOBS = [(src, names, arch) for src, names, archs in TARGETS for arch in archs]
JOB_IDS = [f"{src.name}-{arch}" for src, _, arch in JOBS]


@pytest.fixture(scope="module")
def compiled():  # only requested by @pytest.mark.nvrtc tests
    """(source, names, arch) -> Compiled: every target compiled once, in parallel threads (NVRTC
    is thread-safe and ctypes drops the GIL), bypassing the disk cache. Errors surface per test."""
    jobs = JOBS

    def build(job):
        try:
            return nvrtc.compile_file(job[0], job[1], job[2], cache=False)
        except nvrtc.CompileError as e:
            return e

    with ThreadPoolExecutor(max_workers=min(len(jobs), os.cpu_count() or 1)) as pool:
        done = dict(zip([(str(s), a) for s, _, a in jobs], pool.map(build, jobs)))

    def get(src, names, arch):
        result = done[(str(src), arch)]
        if isinstance(result, Exception):
            raise result
        return result

    return get


@pytest.mark.nvrtc
@pytest.mark.parametrize("src,names,arch", JOBS, ids=JOB_IDS)
def test_compiles_without_warnings(compiled, src, names, arch):
    c = compiled(src, names, arch)
    assert set(c.lowered) == set(names)
    assert len(c.cubin) > 0 and c.cubin[:4] == b"\x7fELF"
    bad = [w for w in c.warnings if not any(a in w for a in ALLOWED_WARNINGS)]
    assert not bad, "compiler warnings:\n" + "\n".join(bad)


@pytest.mark.nvrtc
@pytest.mark.parametrize("src,names,arch", JOBS, ids=JOB_IDS)
def test_no_spills_no_stack_growth(compiled, src, names, arch):
    c = compiled(src, names, arch)
    for ne in names:
        r = c.resource(ne)
        assert r.registers > 0, f"{ne}: no ptxas report parsed"
        assert r.spill_stores == 0 and r.spill_loads == 0, f"{ne} on {arch} spills: {r}"
        family = ne.split("<")[0]
        assert r.stack_frame <= MAX_STACK_FRAME.get(family, 0), f"{ne} on {arch}: stack frame {r.stack_frame} B"


@pytest.mark.nvrtc
@pytest.mark.parametrize("src,names,arch", JOBS, ids=JOB_IDS)
def test_no_wgmma_serialization(compiled, src, names, arch):
    """ptxas serializes every wgmma of a kernel (an info line, not a warning: C7514 / C7515) when
    it cannot prove accumulators untouched while one is in flight, or injects a wait (C7517): a
    silent several-fold slowdown (a second wgmma group waited with wait_group 1 did it)."""
    bad = nvrtc.wgmma_serialized(compiled(src, names, arch).log)
    assert not bad, "\n".join(bad)


MIN_COMBINE_REGISTERS = 64
"""kdtr_flash_combine with fewer registers than this cannot hold a step's partial rows in flight:
ptxas gave it 32 under __launch_bounds__(256) and issued one split's loads after the last one's
use, an L2 round trip per split."""


BATCHED_MERGES = ("kdtr_flash_combine<", "kdtr_flash_combine_narrow<")
"""The merges that hold a batch of partial rows in flight per thread (the narrow one 9 float4 and 9 lse)."""
COMBINE_JOBS = {i: j for i, j in zip(JOB_IDS, JOBS) if any(n.startswith(BATCHED_MERGES) for n in j[1])}


@pytest.mark.nvrtc
@pytest.mark.parametrize("src,names,arch", COMBINE_JOBS.values(), ids=COMBINE_JOBS.keys())
def test_the_split_merge_keeps_its_loads_in_flight(compiled, src, names, arch):
    c = compiled(src, names, arch)
    merges = [n for n in names if n.startswith(BATCHED_MERGES)]
    assert any(n.startswith("kdtr_flash_combine_narrow<") for n in merges)
    for ne in merges:
        assert c.resource(ne).registers >= MIN_COMBINE_REGISTERS, f"{ne} on {arch}: {c.resource(ne)}"


def test_wgmma_serialization_lines_are_found():
    """The lines ptxas printed for flash-sm90's first transposed-rows build are caught."""
    log = (
        "ptxas info    : (C7517) wgmma.wait_group is injected in around line 7936 by compiler to allow use of "
        "registers defined by GMMA in function 'k'\n"
        "ptxas info    : (C7514) Potential Performance Loss: wgmma.mma_async instructions are serialized due to "
        "non wgmma instructions reading accumulator registers of  a wgmma between start and end of the pipeline "
        "stage in the function 'k' in line 0\n"
        "ptxas info    : Used 168 registers, used 16 barriers\n"
    )
    assert [line.split(")")[0][-5:] for line in nvrtc.wgmma_serialized(log)] == ["C7517", "C7514"]
    assert nvrtc.wgmma_serialized("ptxas info    : Used 168 registers, used 16 barriers") == []


@pytest.mark.nvrtc
@pytest.mark.parametrize("arch", kernels.ALL_ARCHS)
def test_kdtr_launch_constant_is_in_the_cubin(compiled, arch):
    src, names, _ = kernels.compile_targets()[0]
    assert b"kdtr_launch" in compiled(src, names, arch).cubin


@pytest.mark.nvrtc
def test_broken_source_gives_the_compilers_error_line():
    src = '#include "kdtr_abi.h"\n__global__ void k(const KdtrParams p) {\n  undefined_thing(p);\n}\n'
    with pytest.raises(nvrtc.CompileError) as info:
        nvrtc.compile_cuda(src, ["k"], "sm_90", name="broken.cu", cache=False)
    text = str(info.value)
    assert "broken.cu(3)" in text and "error" in text and "undefined_thing" in text
    assert "Traceback" not in text
    assert info.value.errors and all("error" in e for e in info.value.errors)


@pytest.mark.nvrtc
def test_warnings_are_reported():
    """The no-warning check above is not vacuous: an unused variable is reported."""
    src = "__global__ void k(int* x) {\n  int unused_local = 3;\n  x[0] = 1;\n}\n"
    c = nvrtc.compile_cuda(src, ["k"], "sm_90", name="warn.cu", cache=False)
    assert any("unused_local" in w for w in c.warnings), c.log


@pytest.mark.nvrtc
def test_cache_round_trip(tmp_path, monkeypatch):
    monkeypatch.setenv("KDTR_CACHE_DIR", str(tmp_path))
    src = '#include "kdtr_abi.h"\n__global__ void k(const KdtrParams p) { p.lse[0] = p.scale; }\n'
    first = nvrtc.compile_cuda(src, ["k"], "sm_80")
    again = nvrtc.compile_cuda(src, ["k"], "sm_80")
    assert not first.from_cache and again.from_cache
    assert first.path == again.path and first.path.parent == tmp_path / "cubin"
    assert again.cubin == first.cubin and again.lowered == first.lowered
    assert again.resource("k") == first.resource("k")
    other = nvrtc.compile_cuda(src, ["k"], "sm_90")  # another arch: another entry
    assert other.key != first.key


def test_parse_resources():
    log = (
        "ptxas info    : Compiling entry function '_Z1kv' for 'sm_90'\n"
        "ptxas info    : Function properties for _Z1kv\n"
        "ptxas         .     24 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads\n"
        "ptxas info    : Used 40 registers, used 1 barriers, 1024 bytes smem, 392 bytes cmem[0]\n"
    )
    r = nvrtc.parse_resources(log)["_Z1kv"]
    assert (r.registers, r.barriers, r.shared_bytes, r.stack_frame, r.spill_stores, r.spill_loads) == (40, 1, 1024, 24, 8, 4)


def test_a_chosen_library_that_does_not_load_fails_and_none_searches_again():
    """use_library pins NVRTC to one file: one that does not load is an error naming it, not a silent fallback
    to another NVRTC (a version comparison would then compare nothing); None restores the search."""
    was = nvrtc.available()
    nvrtc.use_library("/nonexistent/libnvrtc.so.13")
    try:
        assert not nvrtc.available()
        with pytest.raises(nvrtc.NvrtcUnavailable, match="/nonexistent/libnvrtc.so.13"):
            nvrtc.version()
    finally:
        nvrtc.use_library(None)
    assert nvrtc.available() == was


def test_missing_nvrtc_names_the_pip_package(monkeypatch):
    monkeypatch.setattr(nvrtc, "_candidates", lambda: [("/nonexistent/libnvrtc.so.13", None)])
    nvrtc._load.cache_clear()
    try:
        assert not nvrtc.available()
        with pytest.raises(nvrtc.NvrtcUnavailable, match="nvidia-cuda-nvrtc"):
            nvrtc.compile_cuda("__global__ void k() {}", ["k"], cache=False)
    finally:
        nvrtc._load.cache_clear()


@pytest.mark.nvrtc
@pytest.mark.parametrize("env", ["", "1"])
def test_lineinfo_env_adds_line_tables(monkeypatch, env):
    """KDTR_LINEINFO=1 (set for sanitized children) compiles with -lineinfo; unset, it does not."""
    monkeypatch.setenv(nvrtc.LINEINFO_ENV, env)
    c = nvrtc.compile_cuda('extern "C" __global__ void k(float* x) { x[threadIdx.x] += 1.f; }', ["k"], "sm_90",
                           cache=False)
    assert ("-lineinfo" in c.options) == (env == "1")


@pytest.mark.nvrtc
def test_the_profile_build_compiles_clean():
    """flash-sm90 with the one compile switch (-DKDTR_PROFILE, cuda/profile.cuh: tools/profile.py) compiles
    for every main variant without serialized wgmma and without spills, but for one word in the transposed-rows
    build (ROWS_EXTRA sits at the register limit; the counters cost it one), and holds the counter array the tool
    reads; without the switch the array is absent (the shipped builds carry no instrumentation)."""
    from kdtr.kernels import cubin
    from kdtr.kernels.flash.kernel import FLASH_SM90, PROFILE_DEFINE

    names = [n for n in kernels.compile_targets((0,))[2][1] if n.startswith("kdtr_flash_sm90_verify<")]
    assert len(names) == 10
    c = nvrtc.compile_file(FLASH_SM90.source, names, "sm_90a", cache=False, options=(f"-D{PROFILE_DEFINE}",))
    assert not c.warnings and not nvrtc.wgmma_serialized(c.log), c.log
    for n in names:
        allowed = 4 if n.endswith(", 0, 8>") else 0
        assert c.resource(n).spill_stores <= allowed and c.resource(n).spill_loads <= allowed, (n, c.resource(n))
    assert cubin.global_ints(c.cubin, "kdtr_profile", 12) == (0,) * 12
    plain = nvrtc.compile_file(FLASH_SM90.source, names[:1], "sm_90a")
    assert cubin.global_ints(plain.cubin, "kdtr_profile", 12) is None


def test_no_kernel_source_takes_another_switch():
    """The kernels' only preprocessor switch is KDTR_PROFILE (and the arch guards of kdtr_common.cuh): no -D
    experiment knob steers a shipped build."""
    import re

    from kdtr.kernels.nvrtc import CUDA_DIR

    for path in sorted(CUDA_DIR.glob("*.cu*")):
        text = path.read_text()
        switches = set(re.findall(r"#\s*(?:ifn?def|if|elif)\b\s*!?\s*(?:defined\s*\()?\s*(\w+)", text))
        assert switches <= {"KDTR_PROFILE", "__CUDA_ARCH__"}, (path.name, switches)
