"""Bench arithmetic and reporting (no GPU): FLOPs over visible pairs, bytes, roofline, grids, compare."""

import json

import numpy as np
import pytest

from kdtr.bench import run as bench
from kdtr.inputs.cases import CaseSpec, build_problem
from kdtr.inputs.presets import BENCH_GRIDS
from kdtr.inputs.problem import visible_flops

PEAKS = {"gemm_tflops": 800.0, "copy_gbs": 4000.0}


def test_visible_flops_count_only_visible_pairs():
    p, _ = build_problem(CaseSpec(heads=2, prefix_lens=(10, 0), family="chain", budget=3, page_size=4))
    # chain of T = 4: node t sees P + t + 1 keys; request 0: 4*10 + (1+2+3+4), request 1: 0 + 10
    pairs = (40 + 10) + 10
    assert visible_flops(p.prefix_lens, p.tree_depth, p.H) == 2 * 2 * pairs * 1088
    brute = 0
    for b in range(p.B):
        vis = np.unpackbits(p.tree_mask[b].view(np.uint8), axis=-1, bitorder="little")[:, : p.T].sum()
        brute += p.H * (int(p.prefix_lens[b]) * p.T + int(vis))
    assert visible_flops(p.prefix_lens, p.tree_depth, p.H) == 2 * brute * 1088


def test_min_bytes_reads_kv_once_per_request():
    p, _ = build_problem(CaseSpec(heads=4, prefix_lens=(100, 30), budget=8, page_size=64, kv_dtype="bf16"))
    rows = 2 * 9 * 4
    want = (100 + 9 + 30 + 9) * 576 * 2 + rows * 576 * 2 + rows * 512 * 2 + rows * 4
    assert bench.min_bytes(p, "bf16") == want
    assert bench.min_bytes(p, "fp32") == want + rows * 512 * 2


def test_roofline_picks_the_larger_floor():
    assert bench.roofline_ms(800e9, 1, PEAKS) == pytest.approx(1.0)  # compute: 800 GFLOP at 800 TFLOP/s
    assert bench.roofline_ms(1, 4e9, PEAKS) == pytest.approx(1.0)  # memory: 4 GB at 4 TB/s


def test_grid_expands_every_combination_and_the_named_sets():
    specs = bench.grid(["deepseek-v3"], [8], [0, 64], [8192, 32768], [1, 8])
    assert len(specs) == 8 and {s.H for s in specs} == {16}
    assert {s.family for s in specs if s.budget == 0} == {"root"} and {s.T for s in specs} == {1, 65}
    assert {s.B for s in specs} == {1, 8} and all(len(set(s.prefix_lens)) == 1 for s in specs)
    g = BENCH_GRIDS["compute"]
    comp = bench.grid(g["models"], g["tps"], g["budgets"], g["prefixes"], g["batches"])
    assert {s.T for s in comp} == {65, 257, 513} and {max(s.prefix_lens) for s in comp} == {8192, 32768, 131072}


def _run(median_fast, iqr=0.001):
    return {"rows": [{"shape": "s", "cells": [
        {"impl": "flash", "median_ms": median_fast, "iqr_ms": iqr},
        {"impl": "torch-eager", "median_ms": 1.0, "iqr_ms": iqr},
        {"impl": "torch-flex", "median_ms": None, "iqr_ms": None, "status": "error"},
    ]}]}


def test_compare_flags_only_changes_beyond_the_noise():
    res = {(c["impl"]): c for c in bench.compare_runs(_run(0.5), _run(0.25))}
    assert res["flash"]["change"] == "faster" and res["flash"]["ratio"] == pytest.approx(2.0)
    assert res["torch-eager"]["change"] == "same"
    assert "torch-flex" not in res  # never timed: nothing to compare
    noisy = {(c["impl"]): c for c in bench.compare_runs(_run(0.5, iqr=0.2), _run(0.45, iqr=0.2))}
    assert noisy["flash"]["change"] == "same"


def test_csv_and_plot_from_a_saved_run(tmp_path):
    from kdtr.cli import bench as bench_cli

    row = bench.Row("dsv3-x", {"B": 1, "T": 65, "H": 16, "P": 8192, "budget": 64, "model": "deepseek-v3",
                               "page": 64, "kv": "bf16", "out": "bf16"}, 10, 20, 0.01, "compute",
                    [bench.Cell("flash", "ok", 0.1, 0.001, 5, 100.0, 0.2, 0.1, 2.0)])
    from dataclasses import asdict

    data = {"peaks": PEAKS, "rows": [asdict(row)], "impls": ["flash"]}
    bench_cli.write_csv(str(tmp_path / "b.csv"), data)
    lines = (tmp_path / "b.csv").read_text().splitlines()
    assert lines[0].startswith("shape,B,T,H,P") and "flash" in lines[1]
    pytest.importorskip("matplotlib")
    bench_cli.write_plot(str(tmp_path / "b.png"), data)
    assert (tmp_path / "b.png").read_bytes()[:4] == b"\x89PNG"
    json.dumps(data)


def test_committed_sweep_has_both_sets_and_every_baseline():
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "bench.json"
    d = json.loads(path.read_text())
    shapes = {(r["dims"]["model"], r["dims"]["T"], r["dims"]["P"], r["dims"]["B"]) for r in d["rows"]}
    assert len(shapes) == 30
    assert "flash-sm90" in d["impls"] and "torch-eager" in d["impls"]
    for r in d["rows"]:
        assert {c["impl"] for c in r["cells"]} == set(d["impls"])
        for c in r["cells"]:
            assert c["status"] == "ok" and c["median_ms"] > r["roofline_ms"]  # never faster than the floor


def test_timing_without_a_gpu_is_a_clear_error():
    from kdtr.kernels.launch import GpuUnavailable, gpu_available
    from kdtr.bench.timing import measure_peaks, time_launcher

    if gpu_available():
        pytest.skip("this machine has a GPU")
    for call in (lambda: time_launcher(lambda: None), measure_peaks):
        with pytest.raises(GpuUnavailable):
            call()


def test_timing_rejects_an_unknown_flush_mode_before_touching_a_gpu():
    from kdtr.bench.timing import FLUSH_MODE, time_launcher

    assert FLUSH_MODE == "read"  # a written flush bills the timed kernel for its dirty lines (docs/PERF.md)
    with pytest.raises(ValueError, match="flush_mode"):
        time_launcher(lambda: None, flush_bytes=1 << 20, flush_mode="zero")


def test_the_gpu_is_held_longer_than_the_host_enqueues():
    """Events time device work only if the GPU waits until the host has queued the whole call."""
    from kdtr.bench.timing import hold_ns

    assert hold_ns(0.0) == 20_000  # a floor for a cheap launch
    assert hold_ns(1e-3) >= 1.5e6  # a launch-bound baseline's host loop stays hidden
    assert hold_ns(10.0) == 50_000_000  # capped


def test_the_l2_flush_outgrows_the_l2():
    """bench, f90_profile and sol_probe read a buffer of more than twice the L2 between repetitions;
    an unknown L2 counts as 64 MB."""
    from kdtr.bench.timing import l2_flush_bytes

    for l2 in (40 << 20, 50 << 20, 60 << 20, 96 << 20):
        assert l2_flush_bytes(l2) > 2 * l2
    assert l2_flush_bytes(None) == l2_flush_bytes(64 << 20) == 144 << 20
