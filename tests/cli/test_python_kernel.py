"""The Python kernel contract (issue 37, defect 5): `-k path/to/file.py:fn` and `-k module:fn`,
(out, lse) or out alone with kdtr_writes_lse = False, and the kdtr_* attributes checked up front."""

from __future__ import annotations

import json
import textwrap

import pytest

HEADER = '''
from kernels_for_tests import correct  # tests/ is on sys.path under pytest, and in isolated children

from kdtr.kernels.caps import Caps


def cpu(fn):
    fn.kdtr_device = "cpu"
    fn.kdtr_caps = Caps(kv_dtypes=("bf16",))  # what the emulation it wraps takes
    return fn
'''
KERNELS = HEADER + '''
from helper_beside import SCALE  # a module in the same folder: the file's folder is on sys.path


@cpu
def full(q, kv_cache, block_table, prefix_lens, tree_mask, *, scale, page_size, out_dtype):
    return correct(q, kv_cache, block_table, prefix_lens, tree_mask, scale=scale * SCALE, page_size=page_size,
                   out_dtype=out_dtype)


@cpu
def out_only(q, kv_cache, block_table, prefix_lens, tree_mask, *, scale, page_size, out_dtype):
    return full(q, kv_cache, block_table, prefix_lens, tree_mask, scale=scale, page_size=page_size,
                out_dtype=out_dtype)[0]


no_lse = cpu(lambda *a, **k: out_only(*a, **k))
no_lse.kdtr_writes_lse = False

three = cpu(lambda *a, **k: (*full(*a, **k), None))

small_only = cpu(lambda *a, **k: full(*a, **k))
small_only.kdtr_caps = Caps(kv_dtypes=("bf16",), max_T=5)

tpu = cpu(lambda *a, **k: None)
tpu.kdtr_device = "tpu"
torch_on_cpu = cpu(lambda *a, **k: None)
torch_on_cpu.kdtr_framework = "torch"
bad_caps = cpu(lambda *a, **k: None)
bad_caps.kdtr_caps = {"max_T": 5}
lse_text = cpu(lambda *a, **k: None)
lse_text.kdtr_writes_lse = "no"
not_callable = 3
'''


@pytest.fixture(scope="module")
def kernel_file(tmp_path_factory):
    folder = tmp_path_factory.mktemp("user kernels")  # a space in the path, as users have
    (folder / "helper_beside.py").write_text("SCALE = 1.0\n")
    (folder / "my_kernels.py").write_text(textwrap.dedent(KERNELS))
    (folder / "broken_kernels.py").write_text("raise RuntimeError('planted import failure')\n")
    (folder / "bad-name.py").write_text("def fn(): pass\n")
    return folder / "my_kernels.py"


def report_of(kdtr, tmp_path, *args):
    path = tmp_path / "r.json"
    r = kdtr("verify", *args, "--json", path)
    assert path.exists(), r.output
    return r, json.loads(path.read_text())


@pytest.mark.parametrize("mode", [[], ["--no-isolate"]], ids=["isolated", "in-process"])
def test_a_file_kernel_passes(kdtr, small_dir, tmp_path, kernel_file, mode):
    r, rep = report_of(kdtr, tmp_path, "-k", f"{kernel_file}:full", small_dir, *mode)
    assert r.exit_code == 0 and rep["counts"] == {"PASS": 2, "SKIPPED": 1} and rep["lse_checked"], r.output


def test_a_relative_file_path_works_in_isolated_children(kdtr, small_dir, tmp_path, kernel_file, monkeypatch):
    monkeypatch.chdir(kernel_file.parent.parent)
    r, rep = report_of(kdtr, tmp_path, "-k", f"{kernel_file.parent.name}/{kernel_file.name}:full", small_dir)
    assert r.exit_code == 0 and rep["counts"] == {"PASS": 2, "SKIPPED": 1}, r.output


def test_out_alone_is_a_shape_failure_naming_the_fix(kdtr, small_dir, tmp_path, kernel_file):
    r, rep = report_of(kdtr, tmp_path, "-k", f"{kernel_file}:out_only", small_dir)
    assert r.exit_code == 1 and rep["counts"] == {"SHAPE": 2, "SKIPPED": 1}
    shaped = [res for res in rep["results"] if res["status"] == "SHAPE"]
    assert all("kdtr_writes_lse = False" in res["message"] and "(out, lse)" in res["message"] for res in shaped)


def test_out_alone_with_writes_lse_false_passes_and_says_lse_was_not_checked(kdtr, small_dir, tmp_path, kernel_file):
    r, rep = report_of(kdtr, tmp_path, "-k", f"{kernel_file}:no_lse", small_dir)
    assert r.exit_code == 0 and rep["counts"] == {"PASS": 2, "SKIPPED": 1} and rep["lse_checked"] is False
    assert all([c["output"] for c in res["checks"]] == ["out"] for res in rep["results"] if res["status"] == "PASS")
    assert "lse not checked" in " ".join(r.stdout.split())


def test_caps_skip_with_the_reason(kdtr, small_dir, tmp_path, kernel_file):
    r, rep = report_of(kdtr, tmp_path, "-k", f"{kernel_file}:small_only", small_dir)
    assert rep["counts"] == {"PASS": 1, "SKIPPED": 2} and "max_T=5" in r.stdout


def test_a_wrong_number_of_return_values_is_that_case_s_error(kdtr, small_dir, tmp_path, kernel_file):
    r, rep = report_of(kdtr, tmp_path, "-k", f"{kernel_file}:three", small_dir, "--no-isolate")
    assert rep["counts"] == {"RUNTIME_ERROR": 2, "SKIPPED": 1}
    assert all("return (out, lse)" in res["message"] for res in rep["results"] if res["status"] == "RUNTIME_ERROR")


@pytest.mark.parametrize("target, fragment", [
    ("FILE:tpu", "kdtr_device must be one of"),
    ("FILE:torch_on_cpu", "needs kdtr_device 'cuda'"),
    ("FILE:bad_caps", "kdtr_caps must be a kdtr.kernels.caps.Caps"),
    ("FILE:lse_text", "kdtr_writes_lse must be True or False"),
    ("FILE:not_callable", "not a callable"),
    ("FILE:nope", "has no attribute 'nope'"),
    ("DIR/nope.py:fn", "no such Python file"),
    ("DIR/broken_kernels.py:fn", "planted import failure"),
    ("DIR/bad-name.py:fn", "not an importable module name"),
    ("no_such_package.mod:fn", "PYTHONPATH, or name the file: -k path/to/mod.py:fn"),
])
def test_bad_python_kernels_are_one_line(kdtr, small_dir, kernel_file, target, fragment):
    spec = target.replace("FILE", str(kernel_file)).replace("DIR", str(kernel_file.parent))
    r = kdtr("verify", "-k", spec, small_dir)
    assert r.exit_code == 2 and fragment in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.output


def test_module_spec_still_works(kdtr, small_dir, tmp_path):
    bf16 = [p for p in sorted(small_dir.glob("*.kdtr")) if "fp32" not in p.name]
    r, rep = report_of(kdtr, tmp_path, "-k", "kernels_for_tests:correct", *bf16, "--no-isolate")
    assert r.exit_code == 0 and rep["counts"] == {"PASS": 2}
