"""The command line: output, exit codes, one-line errors."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from kdtr.cli import main

GOLDENS = Path(__file__).resolve().parents[2] / "goldens" / "ci"


def run(*args, **kw):
    return CliRunner().invoke(main, list(args), catch_exceptions=False, **kw)


def test_help_is_instant_and_lists_commands():
    out = subprocess.run([sys.executable, "-X", "importtime", "-m", "kdtr", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "verify" in out.stdout and "gen" in out.stdout
    assert "rich" not in out.stderr and "numpy" not in out.stderr and "cupy" not in out.stderr, "heavy import at --help"


def test_list_json_has_suites_and_models():
    r = run("list", "--json")
    assert r.exit_code == 0
    d = json.loads(r.output)
    assert set(d["suites"]) == {"smoke", "ci", "long", "graph"} and d["models"]["deepseek-v3"]["heads_per_gpu"] == 16


def test_gen_explicit_shape_show_and_verify(tmp_path):
    r = run("gen", "--model", "kimi-k2", "--prefix", "0,70", "--budget", "8,16", "--out", str(tmp_path), "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert [b["T"] for b in d["bundles"]] == [9, 17]
    path = d["bundles"][1]["path"]
    r = run("show", path)
    assert r.exit_code == 0 and "depth histogram" in r.output and "tensors" in r.output
    r = run("show", path, "--json")
    assert json.loads(r.output)["tree"]["T"] == 17
    r = run("verify", "-k", "emulate-flash", str(tmp_path), "--json", str(tmp_path / "rep.json"))
    assert r.exit_code == 0, r.output
    rep = json.loads((tmp_path / "rep.json").read_text())
    assert rep["counts"] == {"PASS": 2}


def test_verify_exit_code_1_on_a_planted_bug(tmp_path):
    run("gen", "--prefix", "65", "--budget", "16", "--out", str(tmp_path))
    r = run("verify", "-k", "emulate-flash-bug=scale-off", str(tmp_path))
    assert r.exit_code == 1 and "FAIL_NUMERIC" in r.output


def test_fp32_bundles_are_skipped_by_bf16_kernels_with_a_reason(tmp_path):
    run("gen", "--prefix", "5", "--budget", "4", "--kv-dtype", "fp32", "--out", str(tmp_path))
    r = run("verify", "-k", "emulate-flash", str(tmp_path), "--json", str(tmp_path / "r.json"))
    rep = json.loads((tmp_path / "r.json").read_text())
    assert r.exit_code == 1 and rep["counts"] == {"SKIPPED": 1}  # nothing verified is not a pass
    assert "fp32" in rep["results"][0]["message"]


@pytest.mark.parametrize("args, fragment", [
    (["show", "/nonexistent.kdtr"], "nonexistent"),
    (["verify", "-k", "no-such-kernel", "smoke"], "no-such-kernel"),
    (["verify", "-k", "emulate-flash", "/no/such/dir"], "no such bundle"),
    (["gen", "--prefix", "8q", "--out", "/tmp/x"], "not a size"),
    (["gen"], "nothing to generate"),
    (["gen", "--suite", "nope"], "unknown suite"),
    (["gen", "--model", "llama", "--prefix", "1"], "unknown model"),
    (["verify", "-k", "tests/cuda/broken.cu:broken", "smoke"], "does not compile"),
    (["verify", "-k", "tests/cuda/trap.cu:no_such_symbol", "smoke"], "no_such_symbol"),
    (["verify", "-k", "tests/cuda/nope.cu:k", "smoke"], "no such CUDA file"),
    (["verify", "-k", "kdtr.nosuchmodule:fn", "smoke"], "cannot import"),
    (["verify", "-k", "nosuchmodule:fn", "smoke"], "PYTHONPATH"),
])
def test_user_errors_are_one_line_exit_2(args, fragment):
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 2, (r.exit_code, r.output)
    text = r.stderr.strip()
    assert fragment in text and "Traceback" not in text and len(text.splitlines()) == 1 and not r.stdout, text


@pytest.mark.parametrize("args, fragment", [
    (["gen", "--heads", "abc"], "'abc' is not a valid integer"),
    (["nosuchcommand"], "No such command"),
    (["verify", "smoke"], "Missing option '-k'"),
    (["gen", "--no-such-option"], "No such option"),
])
def test_click_usage_errors_are_one_line_too(args, fragment):
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 2 and not r.stdout, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0] and "--help" in lines[0], r.stderr


def test_gpu_kernel_without_a_gpu_is_a_user_error():
    from kdtr.kernels.launch import gpu_available

    if gpu_available():
        pytest.skip("this machine has a GPU")
    r = CliRunner().invoke(main, ["verify", "-k", "naive", "smoke"])
    assert r.exit_code == 2 and "needs a CUDA GPU" in r.output and "emulate-flash" in r.output


def test_empty_directory_is_a_user_error(tmp_path):
    r = CliRunner().invoke(main, ["verify", "-k", "emulate-flash", str(tmp_path)])
    assert r.exit_code == 2 and "no .kdtr bundles" in r.output


@pytest.mark.skipif(not (GOLDENS / "MANIFEST.json").exists(), reason="goldens/ci not generated")
def test_corrupt_bundle_is_a_user_error(tmp_path):
    src = next(GOLDENS.glob("*.kdtr"))
    data = bytearray(src.read_bytes())
    data[-100] ^= 0x40
    bad = tmp_path / src.name
    bad.write_bytes(bytes(data))
    r = CliRunner().invoke(main, ["verify", "-k", "emulate-flash", str(bad)])
    assert r.exit_code == 2 and "checksum mismatch" in r.output
