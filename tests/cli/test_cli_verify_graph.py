"""`kdtr verify --graph` on the command line: exit codes, the JSON of every capture, the warnings under the
table, 80 columns, and --graph with --repeat, --no-isolate, --sanitize and bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kdtr.cli import report

KERNELS = Path(__file__).resolve().parents[1] / "check" / "graph_kernels.py"


@pytest.fixture
def columns_80(monkeypatch):
    monkeypatch.setattr(report.console(), "width", 80)


def _report(kdtr, tmp_path, *args):
    path = tmp_path / "r.json"
    r = kdtr("verify", *args, "--json", path)
    assert path.exists(), r.output
    return r, json.loads(path.read_text())


def test_graph_passes_the_correct_emulation_and_reports_every_capture(kdtr, tmp_path):
    r, d = _report(kdtr, tmp_path, "-k", "emulate-flash", "graph", "--graph")
    assert r.exit_code == 0 and d["graph"] is True and d["isolated"] is True and d["counts"] == {"PASS": 10}, r.output
    caps = [c for res in d["results"] for c in res["captures"]]
    assert len(caps) == 26 and all(c["status"] == "PASS" and c["ms"] > 0 for c in caps)
    assert {c["fill"] for c in caps if c["sibling"] is None} == {0, 1}
    sib = [c for c in caps if c["sibling"]]
    assert len(sib) == 6 and all(c["fill"] is None and c["layout"].startswith("sibling ") for c in sib)
    assert all(set(res) >= {"captures", "warnings"} for res in d["results"])
    assert "kdtr verify -k emulate-flash --graph" in r.stdout and "26 of 26 captures passed" in r.stdout


def test_graph_fails_the_baked_lengths_bug_that_plain_verify_passes(kdtr, tmp_path, columns_80):
    plain = kdtr("verify", "-k", "emulate-flash-bug=baked-lengths", "graph", "--no-isolate")
    assert plain.exit_code == 0, plain.output
    r = kdtr("verify", "-k", "emulate-flash-bug=baked-lengths", "graph", "--graph", "--no-isolate")
    assert r.exit_code == 1
    lines = r.stdout.splitlines()
    assert max(map(len, lines)) <= 80, "\n".join(lines)
    assert "captured at P=0, replayed at" in r.stdout and "NAN" in r.stdout and "FAIL_NUMERIC" in r.stdout


def test_a_slow_replay_is_shown_under_the_table(kdtr, tmp_path, columns_80):
    from kdtr.golden.store import find_bundles

    two = find_bundles(["graph"])[:2]
    r, d = _report(kdtr, tmp_path, "-k", f"{KERNELS}:cpu_slow_replay", *two, "--graph", "--no-isolate")
    assert r.exit_code == 0 and d["counts"] == {"PASS": 2}, r.output
    assert all(len(res["warnings"]) == len(res["captures"]) for res in d["results"])
    assert "warnings" in r.stdout.splitlines() and "direct launch" in r.stdout
    assert max(map(len, r.stdout.splitlines())) <= 80


def test_graph_with_repeat_in_process_and_the_wide_table(kdtr, tmp_path):
    r, d = _report(kdtr, tmp_path, "-k", "emulate-flash", "graph", "--graph", "--repeat", "3", "--no-isolate", "--wide")
    assert r.exit_code == 0 and d["isolated"] is False, r.output
    assert "replay ms" in r.stdout and "3/3" in r.stdout


def test_graph_json_to_stdout_is_json_alone(kdtr):
    r = kdtr("verify", "-k", "emulate-flash", "graph", "--graph", "--no-isolate", "--json")
    d = json.loads(r.stdout)
    assert r.exit_code == 0 and d["graph"] and all(res["captures"] for res in d["results"])


def test_graph_keeps_the_bad_input_rules(kdtr, tmp_path, monkeypatch):
    import kdtr.check.suite as suite

    monkeypatch.setattr(suite, "run_verify", lambda *a, **k: pytest.fail("work started before the input was checked"))
    r = kdtr("verify", "-k", "emulate-flash", "graph", "--graph", "--json", tmp_path / "missing" / "r.json")
    assert r.exit_code == 2 and "does not exist" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = kdtr("verify", "-k", "emulate-flash", "graph", "--graph", "--no-isolate", "--sanitize", "memcheck")
    assert r.exit_code == 2 and "drop --no-isolate" in r.stderr


def test_render_shows_a_failing_capture_s_figure_and_where(capsys, columns_80):
    from kdtr.cli.verify import case_share, render_verify

    tol = {"atol": 0.01, "rtol": 0.01, "rel_norm": 0.01, "min_cos": 0.999}
    passing = {"output": "out", "status": "PASS", "ratio": 0.5, "rel_norm": 0.001, "cos": 1.0, "tol": tol}
    failing = {**passing, "status": "FAIL_NUMERIC", "ratio": 40.0, "worst": [1, 2, 0, 7],
               "where": "requests 1 of 0-1; heads all 1; nodes all 3"}
    res = {"case": "dsv3-h1-p5.9-chain2-pg1-cap16-bf16-s0", "kernel": "k", "status": "FAIL_NUMERIC",
           "shape": {}, "checks": [passing], "message": "captured at P=1, replayed at P=5..9: FAIL_NUMERIC 3 elements",
           "ms": 1.0, "path": "", "warnings": [],
           "captures": [{"layout": "P=1", "fill": 1, "sibling": None, "status": "FAIL_NUMERIC", "message": "3 elements",
                         "ms": 1.0, "checks": [failing]}]}
    assert case_share(res) == (40.0, "out elem")
    render_verify({"kernel": "k", "device": "cpu", "seconds": 1.0, "counts": {"FAIL_NUMERIC": 1}, "graph": True,
                   "results": [res]})
    out = capsys.readouterr().out
    assert "0 of 1 captures passed" in out and "40.00" in out and "(worst element at (1, 2, 0, 7))" in out
    assert "out failing in requests 1 of 0-1" in out
