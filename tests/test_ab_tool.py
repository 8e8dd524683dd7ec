"""tools/ab.py's tree mode without a GPU: bad --tree input refused in one line, and the rounds of the trees' worker
processes (faked here) interleaved, merged by shape and labelled SPEC@NAME."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tool_loader import load_tool

ROOT = Path(__file__).resolve().parent.parent
TOOL = ROOT / "tools" / "ab.py"


def _ab():
    return load_tool("ab")


def _tree(path: Path) -> Path:
    (path / "kdtr").mkdir(parents=True)
    (path / "kdtr" / "__init__.py").write_text("")
    (path / "cuda").mkdir()
    return path


@pytest.mark.parametrize("trees, says", [
    (["--tree", "/nonexistent/kdtr", "--tree", "."], "is not a kdtr source tree"),
    (["--tree", "."], "give two trees or more"),
    (["--tree", ".", "--tree", "x=."], "two trees are labelled"),
])
def test_bad_trees_get_one_line_and_exit_2_before_any_gpu_work(trees, says):
    argv = [a.replace("x=.", f"{ROOT.name}={ROOT}") for a in trees]
    done = subprocess.run([sys.executable, str(TOOL), "-k", "flash", *argv, "--set", "compute"], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 2 and says in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_the_worker_refuses_a_kdtr_from_outside_its_tree(tmp_path):
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"tree": str(_tree(tmp_path / "other")), "tmp": str(tmp_path), "round": 0,
                               "first_tree": True, "args": {}, "out": str(tmp_path / "rows.json")}))
    with pytest.raises(SystemExit) as e:
        _ab().worker(str(job))
    assert "kdtr came from" in str(e.value) and not (tmp_path / "rows.json").exists()


def test_rounds_interleave_the_trees_and_merge_by_shape(tmp_path, monkeypatch):
    ab = _ab()
    trees = ab.parse_trees([f"main={_tree(tmp_path / 'a')}", str(_tree(tmp_path / 'b'))])
    assert [n for n, _ in trees] == ["main", "b"]
    calls = []

    def fake_run(cmd, env, **kw):  # a worker: tree a's specs take 10 / 20 ms, b's 8 / 16, plus the round
        job = json.loads(Path(cmd[-1]).read_text())
        tree, r = Path(job["tree"]), job["round"]
        assert env["PYTHONPATH"].split(os.pathsep)[0] == str(tree) and "KDTR_CUDA_DIR" not in env
        calls.append((tree.name, r))
        base = 10.0 if tree.name == "a" else 8.0
        cells = [{"spec": k, "status": "ok", "rounds_ms": [base * (i + 1) + r], "differing": 0 if r == 0 else None}
                 for i, k in enumerate(job["args"]["kernel"])]
        rows = [{"shape": "s1", "dims": {"model": "m", "T": 5, "P": 1024, "B": 1}, "roofline_ms": 1.0, "cells": cells}]
        Path(job["out"]).write_text(json.dumps({"peaks": {"device": tree.name}, "rows": rows}))
        return argparse.Namespace(returncode=0, stdout="")

    monkeypatch.setattr(ab.subprocess, "run", fake_run)
    monkeypatch.setenv("KDTR_CUDA_DIR", "/elsewhere")
    args = argparse.Namespace(**{a: None for a in ab.JOB_ARGS}, rounds=3)
    args.kernel = ["flash", "flash[mt=2]"]
    peaks, rows, labels = ab.run_trees(args, trees)
    assert calls == [("a", 0), ("b", 0), ("b", 1), ("a", 1), ("a", 2), ("b", 2)]
    assert labels == ["flash@main", "flash[mt=2]@main", "flash@b", "flash[mt=2]@b"] and peaks == {"device": "a"}
    (row,) = rows
    assert [c["spec"] for c in row["cells"]] == labels
    assert [c["rounds_ms"] for c in row["cells"]] == [[10, 11, 12], [20, 21, 22], [8, 9, 10], [16, 17, 18]]
    assert [c["median_ms"] for c in row["cells"]] == [11, 21, 9, 17] and all(c["spread_ms"] == 1 for c in row["cells"])
    assert all(c["differing"] == 0 for c in row["cells"])  # round 0's count kept


@pytest.mark.gpu
def test_two_copies_of_one_tree_time_alike_and_give_the_same_bits(tmp_path):
    """The tree mode end to end on a GPU: this checkout twice, each round in its own process; the same build gives
    the same bits (0 differing) and a table row a shape."""
    out = tmp_path / "ab.json"
    done = subprocess.run([sys.executable, str(TOOL), "-k", "flash", "--tree", f"a={ROOT}", "--tree", f"b={ROOT}",
                           "--model", "kimi-k2", "--budget", "4", "--prefix", "4k", "--rounds", "2", "--budget-ms", "20",
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads(out.read_text())
    (row,) = report["rows"]
    assert report["specs"] == ["flash@a", "flash@b"] and [c["spec"] for c in row["cells"]] == report["specs"]
    assert all(c["status"] == "ok" and len(c["rounds_ms"]) == 2 and c["differing"] == 0 for c in row["cells"])
    assert "A/B" in done.stdout


def test_a_stopped_run_keeps_its_rounds_in_the_json(tmp_path, monkeypatch):
    """Stopped in tree b's second round (SIGTERM reaches ab.py as KeyboardInterrupt), the rounds done and the shape
    that round had finished are merged and written, marked partial; the cells never timed say so."""
    ab = _ab()
    trees = ab.parse_trees([f"a={_tree(tmp_path / 'a')}", f"b={_tree(tmp_path / 'b')}"])
    calls = []

    def fake_run(cmd, env, **kw):  # two shapes a round; the third worker (b, round 1) is stopped after one of them
        job = json.loads(Path(cmd[-1]).read_text())
        calls.append(job["round"])
        shapes = ["s1"] if len(calls) == 3 else ["s1", "s2"]
        rows = [{"shape": s, "dims": {"model": "m", "T": 5, "P": 1024, "B": 1}, "roofline_ms": 1.0,
                 "cells": [{"spec": "flash", "status": "ok", "rounds_ms": [10.0 + len(calls)], "differing": 0}]}
                for s in shapes]
        Path(job["out"]).write_text(json.dumps({"peaks": {"device": "gpu"}, "rows": rows}))
        if len(calls) == 3:
            raise KeyboardInterrupt
        return argparse.Namespace(returncode=0, stdout="")

    monkeypatch.setattr(ab.subprocess, "run", fake_run)
    args = argparse.Namespace(**{a: None for a in ab.JOB_ARGS}, rounds=2, json=str(tmp_path / "ab.json"))
    args.kernel = ["flash"]
    labels = ab.tree_labels(args.kernel, trees)
    progress = ab.Progress(args, labels, labels, trees)
    with pytest.raises(KeyboardInterrupt):
        ab.run_trees(args, trees, progress)
    saved = json.loads((tmp_path / "ab.json").read_text())
    assert saved["partial"] is True and saved["specs"] == ["flash@a", "flash@b"] and saved["peaks"] == {"device": "gpu"}
    by_shape = {r["shape"]: [c["rounds_ms"] for c in r["cells"]] for r in saved["rows"]}
    assert by_shape == {"s1": [[11.0], [12.0, 13.0]], "s2": [[11.0], [12.0]]}
    (s2,) = [r for r in saved["rows"] if r["shape"] == "s2"]
    assert all(c["status"] == "ok" and c["median_ms"] for c in s2["cells"])
    progress.save(partial=False)
    assert json.loads((tmp_path / "ab.json").read_text())["partial"] is False


def test_a_cell_no_round_timed_says_why():
    rows = _ab().finish_rows({"s1": {"shape": "s1", "cells": {"flash@a": {"status": "ok", "rounds_ms": [],
                                                                          "differing": None}}}}, ["flash@a", "flash@b"])
    assert [c["status"] for c in rows[0]["cells"]] == ["missing: not timed (stopped first)",
                                                       "missing: not timed (no such shape, or stopped first)"]


def test_stopped_it_prints_what_was_done_writes_it_partial_and_exits_130(tmp_path, monkeypatch, capsys):
    ab = _ab()
    import kdtr.kernels.launch as launch

    out = tmp_path / "ab.json"
    monkeypatch.setattr(sys, "argv", ["ab.py", "-k", "flash", "--tree", f"a={ROOT}", "--tree", f"b={ROOT}",
                                      "--set", "memory", "--json", str(out)])
    monkeypatch.setattr(launch, "gpu_available", lambda: True)
    peaks = {"device": "gpu", "copy_gbs": 3000.0, "gemm_tflops": 800.0, "mma_tflops": 630.0}
    cell = {"status": "ok", "rounds_ms": [0.05], "differing": 0}
    rows = [{"shape": "s1", "dims": {"model": "kimi-k2", "T": 5, "P": 32768, "B": 1}, "roofline_ms": 0.0125,
             "cells": [{**cell, "spec": "flash@a"}, {**cell, "spec": "flash@b", "rounds_ms": [0.04]}]}]
    for c in rows[0]["cells"]:
        ab.summarize(c)

    def stopped(args, trees, progress):  # one tree round each, then SIGTERM
        progress.update(peaks, rows)
        raise KeyboardInterrupt

    monkeypatch.setattr(ab, "run_trees", stopped)
    with pytest.raises(SystemExit) as e:
        ab.main()
    shown = capsys.readouterr()
    assert e.value.code == 130 and "stopped" in shown.err
    assert "kimi-k2 T5 P32k B1" in shown.out and "1.250x" in shown.out and "peaks on gpu" in shown.out
    saved = json.loads(out.read_text())
    assert saved["partial"] is True and saved["rows"][0]["cells"][1]["median_ms"] == 0.04
