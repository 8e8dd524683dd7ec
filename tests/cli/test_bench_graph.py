"""`kdtr bench --graph` on the command line: offered, its options checked before any GPU work."""

from __future__ import annotations

import pytest

from kdtr.kernels.launch import gpu_available


def test_help_offers_graph(kdtr):
    r = kdtr("bench", "--help")
    assert r.exit_code == 0 and "--graph" in r.output and "CUDA graph" in r.output


@pytest.mark.parametrize("args, fragment", [
    (["--graph"], "no shapes"),
    (["--graph", "--set", "memory", "-k", "no-such-kernel"], "unknown kernel"),
    (["--graph", "--set", "memory", "--baselines", "eager,fast"], "unknown baseline"),
])
def test_graph_runs_validate_before_the_gpu(kdtr, args, fragment):
    r = kdtr("bench", *args)
    assert r.exit_code == 2 and fragment in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.output


@pytest.mark.skipif(gpu_available(), reason="this machine has a GPU")
def test_graph_with_good_options_and_no_gpu_says_so(kdtr):
    r = kdtr("bench", "--graph", "--set", "memory", "--baselines", "none")
    assert r.exit_code == 2 and "none here" in r.stderr and "the options are fine" in r.stderr
