"""What the commands print: one --json convention everywhere (defect 9), a verify table that fits
80 columns and shows the figure that decides (defect 10), kdtr list with kernels and bugs (defect 11)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kdtr.check.compare import Status
from kdtr.cli import report
from kdtr.kernels import nvrtc
from kdtr.kernels.bugs import PLANTED
from kdtr.kernels.registry import BASES

TEST_CUDA = Path(__file__).resolve().parents[1] / "cuda"
STATUSES = {s.value for s in Status}
BENCH_RUN = {"rows": [{"shape": "s", "cells": [{"impl": "flash", "median_ms": 1.0, "iqr_ms": 0.01}]}]}


def commands(small_dir, tmp_path):
    """One invocation of every command that takes --json (compile where NVRTC is installed)."""
    (tmp_path / "b.json").write_text(json.dumps(BENCH_RUN))
    bundle = sorted(small_dir.glob("*.kdtr"))[0]
    out = [["list"], ["show", bundle], ["gen", "--prefix", "5", "--budget", "4", "--out", tmp_path / "gen"],
           ["gen", "--check", "--out", small_dir], ["verify", "-k", "emulate-flash", small_dir],
           ["bench", "compare", tmp_path / "b.json", tmp_path / "b.json"]]
    if nvrtc.available():
        out.append(["compile", "-k", f"{TEST_CUDA / 'trap.cu'}:kdtr_test_trap", "--arch", "sm_80"])
    return out


@pytest.mark.parametrize("form", ["bare", "dash", "file"])
def test_every_command_follows_one_json_convention(kdtr, small_dir, tmp_path, monkeypatch, form):
    monkeypatch.chdir(tmp_path)  # where a file named "-" would appear
    for i, args in enumerate(commands(small_dir, tmp_path)):
        target = tmp_path / f"out{i}.json"
        extra = {"bare": ["--json"], "dash": ["--json", "-"], "file": ["--json", target]}[form]
        r = kdtr(*args, *extra)
        assert r.exit_code in (0, 1), (args, r.output)
        if form == "file":
            assert json.loads(target.read_text()) and r.stdout.strip() and not r.stdout.lstrip().startswith("{"), args
        else:
            assert isinstance(json.loads(r.stdout), dict), (args, r.stdout[:200])  # JSON and nothing else
    assert not (tmp_path / "-").exists()


def table_rows(lines) -> list[list[str]]:
    """The verify table's rows, split into words: case, status, err/tol, from..."""
    return [ln.split() for ln in lines if len(ln.split()) > 1 and ln.split()[1] in STATUSES]


@pytest.fixture
def columns_80(monkeypatch):
    monkeypatch.setattr(report.console(), "width", 80)


def test_verify_table_fits_80_columns_and_shows_what_decides(kdtr, small_dir, tmp_path, columns_80):
    r = kdtr("verify", "-k", "emulate-flash", small_dir, "--json", tmp_path / "r.json")
    lines = r.stdout.splitlines()
    assert max(map(len, lines)) <= 80, "\n".join(lines)
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["counts"] == {"PASS": 2, "SKIPPED": 1}
    rows = table_rows(lines)
    statuses = {row[1] for row in rows}
    assert statuses == {"PASS", "SKIPPED"}, lines  # never folded into "SKIP / PED"
    for row in rows:
        if row[1] == "PASS":
            assert 0 < float(row[2]) <= 1 and row[3] in ("out", "lse"), row  # the share of the tolerance used
    assert "kimi-h2-p0..130-ddtree4m-pg16-bf16" in r.stdout  # a long prefix list cut to first..last
    assert "storage dtype fp32 not supported" in r.stdout  # the SKIPPED reason below the table


def test_failing_rows_show_a_figure_above_one(kdtr, small_dir, columns_80):
    r = kdtr("verify", "-k", "emulate-flash-bug=scale-off", small_dir)
    rows = table_rows(r.stdout.splitlines())
    failing = [row for row in rows if row[1] == "FAIL_NUMERIC"]
    assert r.exit_code == 1 and len(failing) == 2 and all(float(row[2]) > 1 for row in failing), r.stdout
    assert max(map(len, r.stdout.splitlines())) <= 80


def test_wide_shows_every_figure_and_full_names(kdtr, small_dir, columns_80):
    r = kdtr("verify", "-k", "emulate-flash", small_dir, "--wide")
    assert r.exit_code == 0
    header = next(ln for ln in r.stdout.splitlines() if "status" in ln)
    for col in ("BxTxH", "out elem", "out norm", "out cos", "out max|err|", "lse err/tol", "ms"):
        assert col in header, header
    assert "kimi-h2-p0.1.63.64.65.130-ddtree4m-pg16-bf16-s0" in r.stdout


def test_list_shows_kernels_and_planted_bugs(kdtr, columns_80):
    r = kdtr("list")
    assert r.exit_code == 0 and max(map(len, r.stdout.splitlines())) <= 80
    for name in [*BASES, *(b.slug for b in PLANTED), "path/file.py:fn"]:
        assert name in r.stdout, name
    d = json.loads(kdtr("list", "--json").stdout)
    assert [k["name"] for k in d["kernels"]] == list(BASES) and all(k["about"] for k in d["kernels"])
    assert [b["name"] for b in d["bugs"]] == [b.slug for b in PLANTED] and all(b["about"] for b in d["bugs"])
    emulate = next(k for k in d["kernels"] if k["name"] == "emulate-flash")
    assert emulate["needs_gpu"] is False and emulate["kv_dtypes"] == ["bf16"]
