"""Python callables are benchable: ``prepare`` makes the callable's inputs once, from the bench's buffers, and
returns a launcher that only calls it (what ``kdtr bench`` times, as for the built-in kernels). Here on the CPU,
on kdtr.kernels.emulate's host buffers: the launcher gives the run's outputs, and the SGLang layout is converted
in prepare, never in the launcher. A CPU callable is not timed (no device time): the bench SKIPs it, saying so."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from conftest import ROOT
from kdtr.inputs.cases import CaseSpec, build_problem
from kdtr.kernels import python as pykernels
from kdtr.kernels.emulate import HostBuffers
from kdtr.kernels.python import python_kernel

SPEC = CaseSpec(model="kimi-k2", heads=2, prefix_lens=(5, 70), budget=6, page_size=16)
EXAMPLE = f"{ROOT / 'docs' / 'examples' / 'my_verify.py'}:verify"
SGLANG = f"{ROOT / 'tests' / 'adapters' / 'sglang_kernels.py'}:attend"


@pytest.mark.parametrize("spec", [EXAMPLE, SGLANG], ids=["kdtr-layout", "sglang-layout"])
def test_the_prepared_launcher_gives_what_a_run_gives(spec):
    kernel = python_kernel(spec)
    problem = build_problem(SPEC)[0]
    want = kernel.run(problem, "bf16")
    go = kernel.prepare(HostBuffers(problem, "bf16"))
    got_out, got_lse = kernel._outputs(go(), problem)
    np.testing.assert_array_equal(got_out, want.out)
    np.testing.assert_array_equal(got_lse, want.lse)


def test_the_sglang_layout_is_converted_once_in_prepare_not_in_the_timed_call(monkeypatch):
    calls = []
    real = pykernels.to_sglang
    monkeypatch.setattr(pykernels, "to_sglang", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    kernel = python_kernel(SGLANG)
    go = kernel.prepare(HostBuffers(build_problem(SPEC)[0], "bf16"))
    assert len(calls) == 1
    for _ in range(3):
        go()
    assert len(calls) == 1


def test_the_launcher_reads_the_buffers_it_was_prepared_on():
    """kdtr layout: the arrays handed over are the buffers themselves, so new values written there are what the
    next call reads (as the bench's device buffers)."""
    kernel = python_kernel(EXAMPLE)
    a = build_problem(SPEC)[0]
    b = build_problem(replace(SPEC, seed=1))[0]
    bufs = HostBuffers(a, "bf16")
    go = kernel.prepare(bufs)
    bufs.upload(b)
    np.testing.assert_array_equal(kernel._outputs(go(), b)[0], kernel.run(b, "bf16").out)


def test_a_cpu_callable_is_not_timed_and_says_why():
    assert "no device time" in python_kernel(EXAMPLE).untimed
    assert python_kernel(f"{ROOT / 'tests' / 'check' / 'graph_kernels.py'}:cupy_correct").untimed is None
