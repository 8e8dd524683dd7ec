"""SGLang's own kernel (its triton extend_attention_fwd with a custom mask) through kdtr.adapters.sglang: loaded
from the installed sglang without its package __init__s, leaving sys.modules as it was; where sglang is missing
the reason is one line and the sglang-triton baseline SKIPs with it. Where sglang and triton are installed it
runs here on the CPU too, under triton's interpreter (fp32: the interpreter's bf16 is not the GPU's), and matches
the float64 reference; on a GPU `kdtr verify -k kdtr.adapters.sglang_triton:extend_attention` passes the bf16
ci cases and the baseline is timed."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT
from kdtr.adapters import sglang_triton

needs_sglang = pytest.mark.skipif(sglang_triton.sglang_root() is None or importlib.util.find_spec("triton") is None,
                                  reason="sglang (pip install --no-deps sglang) or triton is not installed here")
"""Decided without loading anything at collection (loading the kernel initialises CUDA through torch)."""


def loadable():
    """Skips, with the reason, where sglang's kernel does not load."""
    why = sglang_triton.unavailable_reason()
    if why:
        pytest.skip(f"sglang's kernel does not load here: {why}")


def test_without_sglang_the_reason_is_one_line_and_the_baseline_skips_with_it(monkeypatch):
    from kdtr.bench.baselines import baseline

    monkeypatch.setattr(sglang_triton, "sglang_root", lambda: None)
    sglang_triton._outcome.cache_clear()
    try:
        why = sglang_triton.unavailable_reason()
        assert why.startswith("sglang is not installed") and "\n" not in why
        b = baseline("sglang-triton")
        assert b.name == "sglang-triton" and b.untimed == f"sglang-triton: {why}"
        with pytest.raises(sglang_triton.SglangUnavailable):
            sglang_triton.extend_attention(*[None] * 10, scale=0.1, out_dtype="bf16")
    finally:
        sglang_triton._outcome.cache_clear()


def test_a_failed_load_is_looked_for_once(monkeypatch):
    calls = []
    monkeypatch.setattr(sglang_triton, "sglang_root", lambda: calls.append(1))
    sglang_triton._outcome.cache_clear()
    try:
        for _ in range(3):
            with pytest.raises(sglang_triton.SglangUnavailable, match="not installed"):
                sglang_triton.load()
        assert sglang_triton.unavailable_reason().startswith("sglang is not installed") and len(calls) == 1
    finally:
        sglang_triton._outcome.cache_clear()


def test_an_unknown_baseline_names_sglang_triton_among_the_known():
    from kdtr.bench.baselines import baseline

    with pytest.raises(ValueError, match="sglang-triton"):
        baseline("vllm")


def test_a_package_without_the_kernel_file_is_a_clear_reason(tmp_path, monkeypatch):
    (tmp_path / "sglang").mkdir()
    monkeypatch.setattr(sglang_triton, "sglang_root", lambda: tmp_path / "sglang")
    sglang_triton._outcome.cache_clear()
    try:
        why = sglang_triton.unavailable_reason()
        if importlib.util.find_spec("torch") and importlib.util.find_spec("triton"):
            assert why.startswith("no extend_attention.py in")
        else:
            assert "needs torch" in why or "needs triton" in why
    finally:
        sglang_triton._outcome.cache_clear()


INTERPRETED = """
import json, sys
import numpy as np, torch
from kdtr.adapters.sglang import to_sglang
from kdtr.adapters.sglang_triton import extend_attention
from kdtr.golden.reference import reference
from kdtr.inputs.cases import CaseSpec, build_problem
from kdtr.kernels.python import SGLANG_ARGS

pr = build_problem(CaseSpec(model="kimi-k2", heads=2, prefix_lens=(5, 40), budget=6, page_size=16, kv_dtype="fp32",
                            out_dtype="fp32"))[0]
batch = to_sglang(pr)
t = {k: torch.from_numpy(np.ascontiguousarray(getattr(batch, k))) for k in SGLANG_ARGS}
t["v_buffer"], t["v_extend"] = t["k_buffer"][..., :512], t["k_extend"][..., :512]
out = extend_attention(*[t[k] for k in SGLANG_ARGS], scale=pr.scale, out_dtype="fp32")
want = reference(pr)[0].reshape(out.shape)
print(json.dumps({"err": float(np.abs(out.numpy() - want).max()),
                  "left": [k for k in sys.modules if k == "sglang" or k.startswith("sglang.")]}))
"""


@needs_sglang
def test_sglangs_kernel_through_the_adapter_matches_the_reference_under_tritons_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    r = subprocess.run([sys.executable, "-c", INTERPRETED], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["err"] < 1e-4 and got["left"] == [], got


@pytest.mark.gpu
@needs_sglang
def test_sglangs_kernel_passes_the_bf16_ci_cases_through_the_adapter(kdtr):
    """bf16 storage, as SGLang serves MLA (fp32 storage goes through triton's default TF32 dots: not judged here)."""
    import re

    from conftest import GOLDENS_CI

    loadable()
    bundles = sorted(p for p in GOLDENS_CI.glob("*.kdtr") if re.search(r"-pg\d+-bf16", p.name))
    assert len(bundles) >= 10
    r = kdtr("verify", "-k", "kdtr.adapters.sglang_triton:extend_attention", *bundles, "--json", "-")
    assert r.exit_code == 0, r.output
    counts = json.loads(r.stdout)["counts"]
    assert counts == {"PASS": len(bundles)}, counts


@pytest.mark.gpu
@needs_sglang
def test_the_sglang_triton_baseline_is_checked_and_timed():
    loadable()
    from kdtr.bench import run
    from kdtr.bench.baselines import baseline
    from kdtr.inputs.cases import CaseSpec
    from kdtr.kernels.registry import resolve_kernel

    spec = CaseSpec(model="kimi-k2", heads=8, prefix_lens=(1000, 3000), budget=8, page_size=64)
    row = run.bench_shape(spec, [baseline("sglang-triton"), resolve_kernel("flash")],
                          {"gemm_tflops": 700.0, "copy_gbs": 4000.0}, time_kw={"warmup_ms": 5.0, "budget_ms": 150.0})
    cells = {c.impl: c for c in row.cells}
    assert cells["sglang-triton"].status == "ok" and cells["sglang-triton"].median_ms > 0, cells["sglang-triton"]
