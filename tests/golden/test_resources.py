"""Cases too big for host memory are refused up front with the estimate (issue 6)."""

from __future__ import annotations

import os
import struct
import tracemalloc

import pytest

from kdtr.golden import generate as gen
from kdtr.golden import resources
from kdtr.golden.bundle import save_bundle
from kdtr.inputs.cases import CaseSpec
from kdtr.golden.resources import GIB, ResourceError, available_bytes, check_fits, estimate

GIGANTIC = CaseSpec(model="deepseek-v3", heads=128, prefix_lens=(1 << 20,) * 64, budget=1024)
"""B = 64, P = 1M each, H = 128, T = 1025: ~130 GiB (77 GB of cache alone)."""
SMALL = CaseSpec(heads=2, prefix_lens=(0, 9), budget=8, page_size=4)


def test_gigantic_case_is_refused_with_the_estimate(monkeypatch):
    monkeypatch.setattr(resources, "available_bytes", lambda: int(23.4 * GIB))
    need = estimate(GIGANTIC).total
    assert 120 * GIB < need < 140 * GIB
    with pytest.raises(ResourceError) as info:
        check_fits([SMALL, GIGANTIC])
    msg = str(info.value)
    assert msg == (f"{GIGANTIC.name}: needs ~{need / GIB:.1f} GiB of host memory, this machine has 23.4 GiB "
                   "available; use a smaller shape or --force")
    assert isinstance(info.value, ValueError)  # the CLI prints ValueErrors as one line, exit code 2


def test_limit_bytes_overrides_the_machine_and_counts_other_refusals():
    big = [CaseSpec(heads=16, prefix_lens=(p,), budget=64) for p in (200_000, 300_000)]
    with pytest.raises(ResourceError, match=r"^dsv3-h16-p300000-.*: needs ~1\.\d GiB .* has 600\.0 MiB available \(and 1 more case\);"):
        check_fits(big + [SMALL], limit_bytes=600 << 20)
    check_fits(big, limit_bytes=8 * GIB)


def test_force_skips_the_check():
    check_fits([GIGANTIC], force=True, limit_bytes=1)


def test_small_cases_fit_this_machine():
    check_fits([SMALL, CaseSpec(heads=16, prefix_lens=(8192,), budget=256)])
    assert estimate(SMALL).total < resources.PROCESS_BASE + (16 << 20)


def test_jobs_at_once_are_summed():
    specs = [CaseSpec(heads=16, prefix_lens=(p,), budget=64) for p in (20_000, 30_000, 40_000)]
    one = max(estimate(s).total for s in specs)
    check_fits(specs, limit_bytes=one, jobs=1)
    with pytest.raises(ResourceError, match=r"^with -j 3 the 3 largest cases need ~.* at once, this machine has"):
        check_fits(specs, limit_bytes=one, jobs=3)
    check_fits(specs, limit_bytes=one, jobs=3, force=True)


def test_generate_refuses_before_writing_anything(tmp_path, monkeypatch):
    monkeypatch.setattr(resources, "available_bytes", lambda: 16 * GIB)
    out = tmp_path / "goldens"
    with pytest.raises(ResourceError, match="needs ~"):
        gen.generate([SMALL, GIGANTIC], out)
    assert not out.exists()


def test_generate_force_goes_ahead(tmp_path, monkeypatch):
    """force=True skips the check (stage_case is replaced: nothing is really generated)."""
    monkeypatch.setattr(resources, "available_bytes", lambda: 16 * GIB)
    staged = []

    def fake_stage(spec, out_dir, entry=None):
        staged.append(spec.name)
        raise KeyboardInterrupt  # stop right there, as a user would

    monkeypatch.setattr(gen, "stage_case", fake_stage)
    with pytest.raises(KeyboardInterrupt):
        gen.generate([GIGANTIC], tmp_path, force=True)
    assert staged == [GIGANTIC.name]


def test_unknown_available_memory_skips_the_check(monkeypatch):
    monkeypatch.setattr(resources, "available_bytes", lambda: None)
    check_fits([GIGANTIC])


@pytest.mark.parametrize("spec", [
    CaseSpec(heads=16, prefix_lens=(3000, 40), budget=32, page_size=64),  # 2 generator chunks per request
    CaseSpec(heads=1, prefix_lens=(100,), budget=1024, page_size=1, kv_dtype="fp32", out_dtype="fp32"),  # T = 1025
    CaseSpec(model="kimi-k2", heads=8, prefix_lens=(16500,), family="root", budget=0),  # 2 reference chunks
    CaseSpec(heads=4, prefix_lens=(0,) * 50, budget=16, page_size=1),  # many requests
])
def test_estimate_bounds_the_real_peak(tmp_path, spec):
    """build_bundle + save_bundle under tracemalloc: the estimate is above the peak, and not by much."""
    tracemalloc.start()
    try:
        b = gen.build_bundle(spec)
        save_bundle(tmp_path / "x.kdtr", b.problem, b.out, b.lse, b.meta, draft_logp=b.draft_logp)
        del b
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    est = estimate(spec).arrays
    assert peak <= est <= 1.8 * peak, (peak, est)


@pytest.mark.parametrize("spec", [
    SMALL,
    CaseSpec(model="kimi-k2", heads=3, prefix_lens=(5, 64), family="chain", budget=40, page_size=1, kv_dtype="fp32"),
    CaseSpec(heads=1, prefix_lens=(33,), family="root", budget=0),
    CaseSpec(heads=2, prefix_lens=(1,), family="star", budget=16, out_dtype="fp32"),
    CaseSpec(heads=2, prefix_lens=(1, 70), budget=16, page_size=16, capacity=200),  # buffers sized by capacity
])
def test_nbytes_estimate_is_the_data_region(tmp_path, spec):
    b = gen.build_bundle(spec)
    save_bundle(tmp_path / "x.kdtr", b.problem, b.out, b.lse, b.meta, draft_logp=b.draft_logp)
    raw = (tmp_path / "x.kdtr").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    assert spec.nbytes_estimate() == len(raw) - 8 - n


def test_available_bytes_on_this_machine():
    avail = available_bytes()
    assert avail is None or 0 < avail < os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * 2


@pytest.mark.parametrize("layout, expect_gib", [
    ({}, 23.4),  # no cgroup files: MemAvailable
    ({"memory.max": "max\n", "memory.current": "1\n"}, 23.4),  # cgroup v2 without a limit
    ({"memory.max": str(8 * GIB), "memory.current": str(3 * GIB), "memory.stat": f"anon 1\ninactive_file {GIB}\n"}, 6.0),
    ({"memory/memory.limit_in_bytes": "9223372036854771712", "memory/memory.usage_in_bytes": "5"}, 23.4),  # v1 unlimited
    ({"memory/memory.limit_in_bytes": str(4 * GIB), "memory/memory.usage_in_bytes": str(GIB),
      "memory/memory.stat": f"total_inactive_file {GIB // 2}\n"}, 3.5),
    ({"memory.max": str(64 * GIB), "memory.current": "0"}, 23.4),  # a limit above what the host has
])
def test_available_bytes_reads_meminfo_and_cgroups(tmp_path, layout, expect_gib):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal:       32000000 kB\nMemAvailable:   {int(23.4 * GIB) // 1024} kB\n")
    for name, text in layout.items():
        (tmp_path / "cg" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "cg" / name).write_text(text)
    got = available_bytes(str(meminfo), str(tmp_path / "cg"))
    assert round(got / GIB, 1) == expect_gib


def test_available_bytes_without_meminfo_uses_sysconf(tmp_path):
    got = available_bytes(str(tmp_path / "missing"), str(tmp_path / "no-cgroup"))
    assert got is None or got > 0


def test_cli_gen_refuses_in_one_line(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from kdtr.cli import main

    monkeypatch.setattr(resources, "available_bytes", lambda: 4 * GIB)
    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["gen", "--tp", "1", "--prefix", "1m,1m", "--budget", "1024", "--out", str(out)])
    assert r.exit_code == 2, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and "needs ~" in lines[0] and "4.0 GiB available" in lines[0] and "--force" in lines[0]
    assert "Traceback" not in r.output and not out.exists()
