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
