"""A stopped `kdtr bench` keeps what it timed: --json is rewritten after every shape, and Ctrl-C or SIGTERM
ends the run with the shapes done shown, written and marked partial (exit 130). The GPU work is faked."""

from __future__ import annotations

import json
import os
import signal

import pytest

from kdtr.bench import run as bench_run_module
from kdtr.bench.run import Cell, Row
from kdtr.cli import bench as bench_cli
from kdtr.cli.options import EXIT_INTERRUPTED

SHAPES = ["deepseek-v3", "kimi-k2"]
PEAKS = {"device": "fake", "copy_gbs": 3000.0, "gemm_tflops": 800.0}


class Spec:
    def __init__(self, name):
        self.name = name


def fake_row(spec) -> Row:
    return Row(spec.name, {"B": 1, "T": 5, "H": 8, "P": 1024}, 10**9, 10**7, 0.01, "memory",
               [Cell("naive", "ok", median_ms=1.0, iqr_ms=0.01, tflops=1.0, gbs=10.0, pct_roofline=0.01)])


def timing(monkeypatch, stop_at=None, how=None):
    """bench_shape faked: a Row per shape, or at shape ``stop_at`` Ctrl-C (``how`` "int") or SIGTERM ("term")."""
    seen = []

    def bench_shape(spec, impls, peaks, check=True, graph=False):
        seen.append(spec.name)
        if len(seen) == stop_at and how == "term":
            os.kill(os.getpid(), signal.SIGTERM)  # the run's handler raises KeyboardInterrupt here
            raise AssertionError("SIGTERM did not stop the run")
        if len(seen) == stop_at:
            raise KeyboardInterrupt
        return fake_row(spec)

    monkeypatch.setattr(bench_run_module, "bench_shape", bench_shape)
    return seen


def test_every_shape_reaches_the_checkpoint_and_a_whole_run_is_not_partial(monkeypatch):
    timing(monkeypatch)
    specs = [Spec(f"s{i}") for i in range(4)]
    saved = []
    d = bench_cli.bench_run(specs, ["naive"], [], PEAKS, check=False, progress=False, checkpoint=saved.append)
    assert [len(s["rows"]) for s in saved] == [1, 2, 3]
    assert [s["partial"] for s in saved] == [{"timed": i, "of": 4} for i in (1, 2, 3)]
    assert "partial" not in d and [r["shape"] for r in d["rows"]] == ["s0", "s1", "s2", "s3"]


@pytest.mark.parametrize("how", ["int", "term"])
def test_an_interrupted_run_returns_the_shapes_done(monkeypatch, how):
    seen = timing(monkeypatch, stop_at=3, how=how)
    before = signal.getsignal(signal.SIGTERM)
    d = bench_cli.bench_run([Spec(f"s{i}") for i in range(5)], ["naive"], [], PEAKS, check=False, progress=False)
    assert seen == ["s0", "s1", "s2"]  # stopped at the third: nothing after it ran
    assert d["partial"] == {"timed": 2, "of": 5} and [r["shape"] for r in d["rows"]] == ["s0", "s1"]
    assert signal.getsignal(signal.SIGTERM) is before  # the SIGTERM handler is the run's only


def test_the_cli_shows_writes_and_exits_130_when_stopped(kdtr, monkeypatch, tmp_path):
    from kdtr.kernels import launch

    timing(monkeypatch, stop_at=2, how="int")
    monkeypatch.setattr(launch, "gpu_available", lambda: True)
    monkeypatch.setattr(bench_cli, "bench_peaks", lambda remeasure=False: PEAKS)
    out = tmp_path / "run.json"
    r = kdtr("bench", "-k", "naive", "--baselines", "none", "--model", ",".join(SHAPES), "--budget", "4",
             "--prefix", "1k", "--json", out)
    assert r.exit_code == EXIT_INTERRUPTED, r.output
    assert "interrupted: 1 of 2 shapes timed" in r.output and "naive" in r.output
    d = json.loads(out.read_text())
    assert d["partial"] == {"timed": 1, "of": 2} and len(d["rows"]) == 1 and d["rows"][0]["cells"][0]["impl"] == "naive"
    # a partial run is still a bench report: compare reads it
    assert kdtr("bench", "compare", out, out).exit_code == 0


def test_a_finished_cli_run_leaves_a_whole_report(kdtr, monkeypatch, tmp_path):
    from kdtr.kernels import launch

    timing(monkeypatch)
    monkeypatch.setattr(launch, "gpu_available", lambda: True)
    monkeypatch.setattr(bench_cli, "bench_peaks", lambda remeasure=False: PEAKS)
    out = tmp_path / "run.json"
    r = kdtr("bench", "-k", "naive", "--baselines", "none", "--model", ",".join(SHAPES), "--budget", "4",
             "--prefix", "1k", "--json", out)
    assert r.exit_code == 0, r.output
    d = json.loads(out.read_text())
    assert "partial" not in d and len(d["rows"]) == 2 and "interrupted" not in r.output


def test_a_worker_of_a_multi_gpu_run_takes_its_gpu_then_times_shapes(monkeypatch):
    import queue

    timing(monkeypatch)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    gpus = queue.Queue()
    gpus.put(3)
    bench_cli._bench_worker_init(gpus, ["naive"], [])
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "3" and [i.name for i in bench_cli._WORKER["impls"]] == ["naive"]
    assert bench_cli._bench_worker((Spec("s"), PEAKS, False, False)).shape == "s"
