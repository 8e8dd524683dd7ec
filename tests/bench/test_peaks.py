"""The mma.sync ceiling beside the GEMM peak (cuda/mma_peak.cu, kdtr/bench/timing.py measure_mma_peak): its loop
compiles for every arch the portable kernel runs on (NVRTC, no GPU), a cached peaks entry from before it is measured
again, each compute-bound timing is held against it (pct_mma_ceiling) through JSON, CSV and the table, and reports
from before it still load and render as they did. The measurement itself is @pytest.mark.gpu (the last test)."""

from __future__ import annotations

import csv
import io
import json
from dataclasses import asdict
from pathlib import Path

import pytest

from kdtr.bench import run, timing
from kdtr.inputs.cases import CaseSpec

ROOT = Path(__file__).resolve().parents[2]
RESULTS = sorted((ROOT / "benchmarks" / "results").glob("bench*.json"))
PEAKS = {"device": "NVIDIA H200", "copy_gbs": 4000.0, "gemm_tflops": 800.0, "mma_tflops": 600.0,
         "mma_method": "mma.sync ... issue loop"}
"""A fake measured run: the mma.sync ceiling at 75 % of the GEMM peak."""


# ---- the loop compiles, and the FLOPs it is credited with ------------------------------------------------

def portable_archs() -> tuple[str, ...]:
    """Every arch the portable kernel is built for (the registry's CI list) and the ones its targets name."""
    from kdtr.kernels.registry import ALL_ARCHS

    return tuple(dict.fromkeys(("sm_80", "sm_86", "sm_89", "sm_90", "sm_120", *ALL_ARCHS)))


@pytest.mark.nvrtc
@pytest.mark.parametrize("arch", portable_archs())
def test_the_mma_loop_compiles_clean_for_every_portable_arch(arch):
    from kdtr.kernels import cubin, nvrtc

    c = nvrtc.compile_file(timing.MMA_PEAK_SOURCE, [timing.MMA_PEAK_KERNEL], arch, cache=False)
    assert not c.warnings, c.log
    if not c.log.strip():  # NVRTC 13.0 has compiled for the GPU's own sm_90 with no ptxas report at all
        pytest.skip(f"this NVRTC ({nvrtc.version()}) printed no ptxas report for {arch}")
    assert len(c.resources) == 1, (arch, c.lowered, c.log)  # the file's one kernel, whatever ptxas names it
    r = next(iter(c.resources.values()))
    threads, chains = cubin.global_ints(c.cubin, "kdtr_mma_peak_shape", 2)
    assert (r.spill_stores, r.spill_loads, r.stack_frame) == (0, 0, 0), (arch, r)  # nothing but registers in the loop
    # one CTA fits an SM's 64K registers and two do not, so a grid of one CTA an SM keeps every SM busy
    assert 32 * 1024 < r.registers * threads <= 64 * 1024, (arch, r)
    assert threads % 32 == 0 and chains >= 8  # enough independent chains a warp to cover the mma latency


def test_the_loop_issues_the_instruction_flash_uses():
    """The ceiling is of flash's own instruction: both call kdtr::mma_bf16, which issues MMA_INSTRUCTION."""
    from kdtr.kernels.nvrtc import CUDA_DIR

    assert f"{timing.MMA_INSTRUCTION} " in (CUDA_DIR / "kdtr_common.cuh").read_text()
    assert "kdtr::mma_bf16(" in timing.MMA_PEAK_SOURCE.read_text()
    assert "mma_bf16(" in (CUDA_DIR / "flash.cu").read_text()  # kdtr::mma_bf16 (flash.cu: `using kdtr::mma_bf16`)


def test_the_loop_is_credited_with_one_m16n8k16_a_warp_a_chain_an_iteration():
    assert timing.MMA_FLOPS == 4096
    assert timing.mma_loop_flops(132, 1024, 8, 8192) == 132 * 32 * 8 * 8192 * 4096
    assert timing.mma_loop_flops(1, 64, 1, 1) == 2 * timing.MMA_FLOPS


def test_measuring_without_a_gpu_is_a_clear_error():
    from kdtr.kernels.launch import GpuUnavailable, gpu_available

    if gpu_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(GpuUnavailable):
        timing.measure_mma_peak()


# ---- the cached peaks ------------------------------------------------------------------------------------

@pytest.fixture
def peaks_cache(tmp_path, monkeypatch):
    """bench_peaks on a fake device, its cache under tmp_path; measure_peaks counts its calls and returns PEAKS."""
    from kdtr.golden import store
    from kdtr.kernels import launch

    calls = []
    monkeypatch.setattr(store, "cache_root", lambda: tmp_path)
    monkeypatch.setattr(launch, "device_info", lambda: {"name": "NVIDIA H200", "driver_version": 13000})
    monkeypatch.setattr(timing, "measure_peaks", lambda: calls.append(1) or dict(PEAKS))
    path = tmp_path / "peaks.json"

    def write(entry):
        path.write_text(json.dumps({"NVIDIA H200|13000": entry}))

    return calls, path, write


OLD_ENTRY = {"device": "NVIDIA H200", "copy_gbs": 4100.0, "gemm_tflops": 790.0, "gemm_method": "torch.matmul bf16 8192^3"}
"""A cache entry written before the mma.sync ceiling was measured."""


def test_a_cached_entry_from_before_the_mma_ceiling_is_measured_again(peaks_cache):
    from kdtr.cli.bench import bench_peaks

    calls, path, write = peaks_cache
    write(OLD_ENTRY)
    pk = bench_peaks()
    assert calls == [1] and pk["mma_tflops"] == 600.0 and pk["gemm_tflops"] == 800.0  # all of it, one run
    assert json.loads(path.read_text())["NVIDIA H200|13000"]["mma_tflops"] == 600.0
    assert bench_peaks()["mma_tflops"] == 600.0 and calls == [1]  # complete now: from the cache


@pytest.mark.parametrize("entry", [{**OLD_ENTRY, "mma_tflops": None, "mma_method": "not measured (CompileError)"},
                                   {**OLD_ENTRY, "mma_tflops": 610.0, "copy_gbs": None}, "damaged"])
def test_an_entry_missing_a_ceiling_is_measured_again(peaks_cache, entry):
    from kdtr.cli.bench import bench_peaks

    calls, _, write = peaks_cache
    write(entry)
    assert bench_peaks()["mma_tflops"] == 600.0 and calls == [1]


def test_a_complete_entry_is_used_unless_remeasure(peaks_cache):
    from kdtr.cli.bench import bench_peaks

    calls, _, write = peaks_cache
    write({**OLD_ENTRY, "mma_tflops": 610.0})
    assert bench_peaks()["mma_tflops"] == 610.0 and calls == []
    assert bench_peaks(remeasure=True)["mma_tflops"] == 600.0 and calls == [1]


def test_bench_peaks_shows_the_mma_ceiling_beside_the_gemm_peak(kdtr, peaks_cache, monkeypatch):
    from kdtr.kernels import launch

    calls, _, write = peaks_cache
    write(OLD_ENTRY)
    monkeypatch.setattr(launch, "gpu_available", lambda: True)
    r = kdtr("bench", "--peaks")
    assert r.exit_code == 0, r.output
    assert "mma_tflops" in r.stdout and "gemm_tflops" in r.stdout and calls == [1]
    assert "mma.sync ceiling 600 TFLOP/s (75% of the GEMM" in " ".join(r.stdout.split())


# ---- held against each compute-bound timing --------------------------------------------------------------

def test_pct_of_the_mma_ceiling_is_for_compute_bound_timings_with_a_ceiling():
    assert run.pct_of_mma_ceiling(450.0, "compute", PEAKS) == pytest.approx(0.75)
    assert run.pct_of_mma_ceiling(450.0, "memory", PEAKS) is None
    assert run.pct_of_mma_ceiling(None, "compute", PEAKS) is None  # not timed
    assert run.pct_of_mma_ceiling(450.0, "compute", {**PEAKS, "mma_tflops": None}) is None  # not measured here
    assert run.pct_of_mma_ceiling(450.0, "compute", {"copy_gbs": 4000.0, "gemm_tflops": 800.0}) is None  # old peaks


class _Timed:
    """An implementation bench_shape times without a GPU (its launcher and time_launcher faked)."""

    name = "flash"

    class caps:  # takes every shape, on no device
        @staticmethod
        def why_not(problem, out_dtype):
            return None

    def prepare(self, dp):
        return lambda: None


@pytest.mark.parametrize("spec,bound", [
    (CaseSpec(model="deepseek-v3", heads=16, prefix_lens=(8192,), budget=64, page_size=64), "compute"),
    (CaseSpec(model="kimi-k2", heads=8, prefix_lens=(8192,), budget=0, family="root", page_size=64), "memory"),
], ids=["compute", "memory"])
def test_bench_shape_fills_the_row_from_the_peaks(monkeypatch, spec, bound):
    from types import SimpleNamespace

    from kdtr.inputs.cases import build_problem

    layout = build_problem(spec, values=False)[0]
    monkeypatch.setattr(run, "device_problem", lambda s, seed=0: SimpleNamespace(problem=layout))
    monkeypatch.setattr(timing, "time_launcher", lambda fn, **kw: {"median_ms": 0.1, "iqr_ms": 0.001, "reps": 10})
    row = run.bench_shape(spec, [_Timed()], PEAKS, check=False)
    (cell,) = row.cells
    assert row.bound == bound and cell.tflops == pytest.approx(row.flops / 1e-4 / 1e12)
    if bound == "compute":
        assert cell.pct_mma_ceiling == pytest.approx(cell.tflops / PEAKS["mma_tflops"])
        assert cell.pct_mma_ceiling > cell.pct_roofline  # the mma.sync ceiling is below the GEMM peak here
    else:
        assert cell.pct_mma_ceiling is None
    old = run.bench_shape(spec, [_Timed()], {k: PEAKS[k] for k in ("copy_gbs", "gemm_tflops")}, check=False)
    assert old.cells[0].pct_mma_ceiling is None and old.cells[0].pct_roofline == cell.pct_roofline


# ---- in the report -------------------------------------------------------------------------------------

DIMS = {"B": 1, "T": 65, "H": 16, "P": 8192, "budget": 64, "model": "deepseek-v3", "page": 64, "kv": "bf16", "out": "bf16"}


def report(mma: bool = True) -> dict:
    """A compute-bound row (flash at 20 % of the mma.sync ceiling) and a memory-bound one, with or without the ceiling."""
    flash = run.Cell("flash", "ok", 0.1, 0.001, 20, 120.0, 90.0, 0.15, 3.0, pct_mma_ceiling=0.2 if mma else None)
    eager = run.Cell("torch-eager", "ok", 0.3, 0.003, 10, 40.0, 30.0, 0.05, 1.0,
                     pct_mma_ceiling=40.0 / 600.0 if mma else None)
    fail = run.Cell("flash-sm90", "skipped: needs sm_90")
    compute = run.Row("dsv3-x", DIMS, 10**10, 2 * 10**7, 0.0125, "compute", [eager, flash, fail])
    memory = run.Row("kimi-x", {**DIMS, "T": 1, "H": 8, "model": "kimi-k2"}, 10**8, 10**9, 0.25, "memory",
                     [run.Cell("flash", "ok", 0.5, 0.005, 20, 0.2, 2000.0, 0.5, 4.0)])
    peaks = PEAKS if mma else {k: v for k, v in PEAKS.items() if not k.startswith("mma")}
    return {"peaks": peaks, "rows": [asdict(compute), asdict(memory)], "impls": ["torch-eager", "flash", "flash-sm90"]}


def test_pct_mma_ceiling_survives_json_and_goes_into_the_csv():
    d = json.loads(json.dumps(report()))
    rows = run.rows_from_json(d["rows"])
    assert rows[0].cells[1].pct_mma_ceiling == 0.2 and rows[1].cells[0].pct_mma_ceiling is None
    assert [asdict(r) for r in rows] == d["rows"]
    lines = list(csv.DictReader(io.StringIO(run.csv_text(rows))))
    header = list(lines[0])
    assert header.index("pct_roofline") + 1 == header.index("pct_mma_ceiling")
    assert [ln["pct_mma_ceiling"] for ln in lines] == [str(40.0 / 600.0), "0.2", "", ""]


def test_the_table_shows_the_mma_column_where_the_run_has_the_ceiling(capsys):
    from kdtr.cli.bench import MMA_COLUMN, render_bench

    render_bench(report())
    out = capsys.readouterr().out
    header = next(ln for ln in out.splitlines() if "impl" in ln)
    assert header.index("% roofline") < header.index(MMA_COLUMN) < header.index("vs torch")
    flash = next(ln for ln in out.splitlines() if " flash " in ln and "dsv3" not in ln and "kimi" not in ln)
    assert "15.0%" in flash and "20.0%" in flash
    kimi = next(ln for ln in out.splitlines() if "kimi-x" in ln)
    assert "50.0%" in kimi and kimi.split("50.0%")[1].split()[0] == "-"  # memory-bound: no mma figure
    assert "mma.sync ceiling 600 TFLOP/s (75% of the GEMM" in " ".join(out.split())


def test_the_table_without_the_ceiling_is_the_table_it_always_was(capsys):
    from kdtr.cli.bench import MMA_COLUMN, render_bench

    render_bench(report(mma=False))
    out = capsys.readouterr().out
    assert MMA_COLUMN not in out and "no mma.sync ceiling (peaks from before it was measured)" in " ".join(out.split())


def test_a_ceiling_that_could_not_be_measured_says_why():
    from kdtr.cli.bench import mma_text

    why = "not measured (CompileError: mma_peak.cu: NVRTC compile failed for sm_75)"
    assert mma_text({**PEAKS, "mma_tflops": None, "mma_method": why}) == f"mma.sync ceiling {why}"


@pytest.mark.parametrize("path", RESULTS, ids=lambda p: p.name)
def test_reports_from_before_the_mma_ceiling_load_and_render(path, capsys):
    from kdtr.cli.bench import MMA_COLUMN, load_bench_report, render_bench

    d = load_bench_report(str(path))
    rows = run.rows_from_json(d["rows"])
    assert rows and all(c.pct_mma_ceiling is None for r in rows for c in r.cells)
    assert all(ln["pct_mma_ceiling"] == "" for ln in csv.DictReader(io.StringIO(run.csv_text(rows))))
    render_bench(d)
    out = capsys.readouterr().out
    assert MMA_COLUMN not in out and "% roofline" in out


@pytest.mark.parametrize("path", sorted((ROOT / "benchmarks" / "results").glob("sweep_*.json")), ids=lambda p: p.name)
def test_the_committed_sweep_loads_and_renders_its_mma_and_graph_columns(path, capsys):
    from kdtr.cli.bench import MMA_COLUMN, load_bench_report, render_bench

    d = load_bench_report(str(path))
    rows = run.rows_from_json(d["rows"])
    compute = [c for r in rows if r.bound == "compute" for c in r.cells if c.status == "ok"]
    assert rows and all(c.pct_mma_ceiling is not None for c in compute)
    assert any(c.graph_status == "ok" for r in rows for c in r.cells)
    render_bench(d)
    out = capsys.readouterr().out
    assert "% roofline" in out and MMA_COLUMN in out  # the ceiling was measured in that run


# ---- on a GPU ------------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_the_mma_ceiling_is_measured_beside_the_gemm_peak():
    pk = timing.measure_peaks(copy_bytes=256 << 20)
    assert pk["mma_tflops"] is not None, pk["mma_method"]
    assert 0.3 * pk["gemm_tflops"] <= pk["mma_tflops"] <= 1.2 * pk["gemm_tflops"], pk
    assert timing.MMA_INSTRUCTION in pk["mma_method"] and pk["mma"]["reps"] >= 3
