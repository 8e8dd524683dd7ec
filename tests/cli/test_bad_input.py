"""Bad input gets one line and exit code 2 before any work is done (issue 37, defects 2, 3, 4, 6, 7)."""

from __future__ import annotations

import json

import pytest

from kdtr.kernels.launch import gpu_available


def one_line_error(r, fragment: str) -> str:
    assert r.exit_code == 2, (r.exit_code, r.output)
    text = r.stderr.strip()
    assert len(text.splitlines()) == 1 and "Traceback" not in text and fragment in text, text
    return text


def nothing_ran(monkeypatch):
    """Make any verification or generation fail the test: the error must come first."""
    import kdtr.check.suite as suite
    import kdtr.golden.generate as generate

    def boom(*a, **k):
        raise AssertionError("work started before the input was checked")

    monkeypatch.setattr(suite, "run_verify", boom)
    monkeypatch.setattr(generate, "generate", boom)


# ---- defect 2: tolerance overrides that would switch a check off

@pytest.mark.parametrize("option, value, fragment", [
    ("--atol", "nan", "finite"), ("--rtol", "nan", "finite"), ("--rel-norm", "nan", "finite"),
    ("--atol", "inf", "finite"), ("--rel-norm", "inf", "finite"), ("--rtol", "-inf", "finite"),
    ("--atol", "-1", ">= 0"), ("--rel-norm", "-0.5", ">= 0"),
])
def test_tolerance_overrides_that_cannot_fail_are_refused(kdtr, small_dir, monkeypatch, option, value, fragment):
    nothing_ran(monkeypatch)
    text = one_line_error(kdtr("verify", "-k", "emulate-flash", small_dir, option, value), fragment)
    assert option.lstrip("-").replace("-", "") in text.replace("_", "").replace("-", "")


def test_a_valid_override_still_applies(kdtr, small_dir, tmp_path):
    r = kdtr("verify", "-k", "emulate-flash", small_dir, "--atol", "0", "--rtol", "0", "--json", tmp_path / "r.json")
    rep = json.loads((tmp_path / "r.json").read_text())
    assert r.exit_code == 1 and rep["counts"].get("FAIL_NUMERIC") == 2  # exact equality is a check that fails
    assert all(c["tol"]["atol"] == 0 for res in rep["results"] for c in res["checks"] if c["output"] == "out")


# ---- defect 4: output paths are checked before anything runs

@pytest.mark.parametrize("command", [["verify", "-k", "emulate-flash", "SMALL"], ["list"], ["gen", "--suite", "smoke"],
                                     ["show", "BUNDLE"], ["bench", "compare", "A.json", "B.json"]])
def test_json_into_a_missing_folder_fails_first(kdtr, small_dir, tmp_path, monkeypatch, command):
    nothing_ran(monkeypatch)
    bundle = next(small_dir.glob("*.kdtr"))
    args = [small_dir if a == "SMALL" else bundle if a == "BUNDLE" else a for a in command]
    text = one_line_error(kdtr(*args, "--json", tmp_path / "missing" / "r.json"), "does not exist")
    assert "missing" in text and ".tmp" not in text


@pytest.mark.parametrize("value, fragment", [("smoke", "must end in .json"), ("DIR", "is a folder"),
                                             ("report.txt", "must end in .json")])
def test_json_paths_that_would_go_wrong(kdtr, small_dir, tmp_path, monkeypatch, value, fragment):
    nothing_ran(monkeypatch)
    value = tmp_path if value == "DIR" else value
    one_line_error(kdtr("verify", "-k", "emulate-flash", small_dir, "--json", value), fragment)


def test_results_are_shown_when_the_file_cannot_be_written_after_all(kdtr, small_dir, tmp_path, monkeypatch):
    import kdtr.golden.atomic as atomic

    def disk_full(path, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(atomic, "atomic_write_bytes", disk_full)
    r = kdtr("verify", "-k", "emulate-flash", small_dir, "--json", tmp_path / "r.json")
    one_line_error(r, "No space left")
    assert "PASS" in r.stdout and "the results are shown above" in r.stderr


# ---- defect 3: bench compare on something that is not a bench report

def test_bench_compare_on_a_verify_report(kdtr, small_dir, tmp_path):
    kdtr("verify", "-k", "emulate-flash", small_dir, "--json", tmp_path / "verify.json")
    bench = {"rows": [{"shape": "s", "cells": [{"impl": "flash", "median_ms": 1.0, "iqr_ms": 0.01}]}]}
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    one_line_error(kdtr("bench", "compare", tmp_path / "verify.json", tmp_path / "bench.json"), "a kdtr verify report")
    for doc in ([1, 2], {"rows": [{"shape": "s"}]}, {"rows": [{"shape": "s", "cells": [{"median_ms": 1}]}]}):
        (tmp_path / "other.json").write_text(json.dumps(doc))
        one_line_error(kdtr("bench", "compare", tmp_path / "bench.json", tmp_path / "other.json"), "not a kdtr bench")
    (tmp_path / "junk.json").write_text("{")
    one_line_error(kdtr("bench", "compare", tmp_path / "junk.json", tmp_path / "bench.json"), "not JSON")
    one_line_error(kdtr("bench", "compare", tmp_path / "nope.json", tmp_path / "bench.json"), "cannot read")
    r = kdtr("bench", "compare", tmp_path / "bench.json", tmp_path / "bench.json")
    assert r.exit_code == 0 and "same" in r.stdout


# ---- defect 6: kdtr gen's options

@pytest.mark.parametrize("args, fragment", [
    (["--heads", "0", "--prefix", "5"], "--heads must be >= 1"),
    (["--tp", "8", "--heads", "4", "--prefix", "5"], "give --tp or --heads, not both"),
    (["--tp", "0", "--prefix", "5"], "--tp must be >= 1"),
    (["--tp", "3", "--prefix", "5"], "do not split over TP=3"),
    (["-j", "0", "--suite", "smoke"], "-j/--jobs must be >= 1"),
    (["-j", "-2", "--suite", "smoke"], "-j/--jobs must be >= 1"),
    (["--budget", "16x", "--prefix", "5"], "--budget 16x: not a whole number: '16x'"),
    (["--budget", "-1", "--prefix", "5"], "--budget must be >= 0"),
    (["--family", "json", "--prefix", "5"], "--family json needs --trees FILE"),
    (["--trees", "t.json", "--prefix", "5"], "--trees is read by --family json only"),
    (["--page-size", "0", "--prefix", "5"], "--page-size must be >= 1"),
    (["--seed", "-1", "--prefix", "5"], "--seed must be >= 0"),
    (["--check", "--prefix", "5"], "drop the shape options"),
    (["--family", "json", "--trees", "kdtr:../x.json", "--prefix", "5"], "inside the kdtr package"),
])
def test_gen_option_gaps(kdtr, tmp_path, monkeypatch, args, fragment):
    nothing_ran(monkeypatch)
    one_line_error(kdtr("gen", *args, "--out", tmp_path), fragment)


def test_gen_heads_and_the_package_trees_work(kdtr, tmp_path):
    r = kdtr("gen", "--heads", "3", "--prefix", "5", "--family", "json", "--trees", "kdtr:data/captured_trees.json",
             "--budget", "23", "--out", tmp_path, "--json")
    assert r.exit_code == 0, r.output
    (b,) = json.loads(r.stdout)["bundles"]
    assert b["H"] == 3 and b["tree"] == "json"


# ---- defect 7: kdtr bench checks its options before asking for a GPU

@pytest.mark.parametrize("args, fragment", [
    (["--set", "nosuch"], "--set nosuch: unknown shape set"),
    (["--set", "memory", "--devices", "0"], "--devices must be >= 1"),
    (["--set", "memory", "-k", "no-such-kernel"], "unknown kernel"),
    (["--set", "memory", "--baselines", "eager,fast"], "unknown baseline"),
    (["--prefix", "8q"], "not a size"),
    (["--budget", "64", "--batch", "1x"], "--batch 1x: not a whole number"),
    (["--set", "memory", "--csv", "MISSING/b.csv"], "does not exist"),
    (["--set", "memory", "--plot", "b.pdf"], "must end in .png"),
    ([], "no shapes"),
])
def test_bench_validates_before_the_gpu(kdtr, tmp_path, args, fragment):
    args = [str(tmp_path / "missing" / "b.csv") if a == "MISSING/b.csv" else a for a in args]
    one_line_error(kdtr("bench", *args), fragment)


@pytest.mark.skipif(gpu_available(), reason="this machine has a GPU")
def test_bench_with_good_options_and_no_gpu_says_so(kdtr):
    one_line_error(kdtr("bench", "--set", "memory", "--baselines", "none"), "none here")
