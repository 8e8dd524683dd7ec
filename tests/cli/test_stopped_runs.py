"""A stopped `kdtr bench` or `kdtr verify` keeps what it did: --json is rewritten after every shape or case,
and Ctrl-C or SIGTERM end the run with the work done shown, written and marked partial (exit 130); a partial
verify is never a pass. bench's GPU work is faked; verify judges the small bundles with emulate-flash."""

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
    # a partial run is still a bench report: compare reads it, and says it was stopped
    c = kdtr("bench", "compare", out, out)
    said = " ".join(c.output.split())
    assert c.exit_code == 0 and "stopped run:" in said and "timed 1 of 2 shapes" in said


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
    before = signal.getsignal(signal.SIGINT)
    monkeypatch.setattr(signal, "signal", lambda sig, handler: before)  # this process keeps its own Ctrl-C
    gpus = queue.Queue()
    gpus.put(3)
    bench_cli._bench_worker_init(gpus, ["naive"], [])
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "3" and [i.name for i in bench_cli._WORKER["impls"]] == ["naive"]
    assert bench_cli._bench_worker((Spec("s"), PEAKS, False, False)).shape == "s"


def stopping_verify(monkeypatch, stop_at: int, how: str = "int"):
    """kdtr.check.suite.verify_bundle wrapped: the real judgement, but Ctrl-C or SIGTERM at case ``stop_at``."""
    from kdtr.check import suite

    seen, real = [], suite.verify_bundle

    def verify_bundle(kernel, bundle, **kw):
        seen.append(bundle)
        if len(seen) == stop_at and how == "term":
            os.kill(os.getpid(), signal.SIGTERM)
            raise AssertionError("SIGTERM did not stop the run")
        if len(seen) == stop_at:
            raise KeyboardInterrupt
        return real(kernel, bundle, **kw)

    monkeypatch.setattr(suite, "verify_bundle", verify_bundle)
    return seen


@pytest.mark.parametrize("how", ["int", "term"])
def test_a_stopped_verify_shows_writes_and_is_not_a_pass(kdtr, monkeypatch, small_dir, tmp_path, how):
    n = len(list(small_dir.glob("*.kdtr")))
    assert n >= 3
    seen = stopping_verify(monkeypatch, stop_at=2, how=how)
    out = tmp_path / "rep.json"
    r = kdtr("verify", "-k", "emulate-flash", small_dir, "--no-isolate", "--json", out)
    assert len(seen) == 2 and r.exit_code == EXIT_INTERRUPTED, r.output
    assert f"interrupted: 1 of {n} cases verified" in r.output and "not a pass" in r.output
    d = json.loads(out.read_text())
    assert d["partial"] == {"verified": 1, "of": n} and len(d["results"]) == 1 and d["failed"] is True


def test_verify_json_is_written_after_every_case(monkeypatch, small_dir):
    from kdtr.check.suite import run_verify
    from kdtr.kernels.registry import resolve_kernel

    paths = sorted(small_dir.glob("*.kdtr"))
    saved = []
    rep = run_verify(resolve_kernel("emulate-flash"), paths, checkpoint=lambda p: saved.append(p.to_json()))
    assert [s["partial"] for s in saved] == [{"verified": i, "of": len(paths)} for i in range(1, len(paths))]
    assert all(s["failed"] for s in saved)  # a report of some cases is never a pass
    whole = rep.to_json()
    assert "partial" not in whole and len(whole["results"]) == len(paths) and whole["failed"] is False
