"""Localisation by request and head: each batch- or head-indexing bug a kernel engineer plants by
mistake fails, and the Check names exactly the requests, heads, nodes and depths it broke.

The bugs are planted in numpy on a small Problem's float64 reference; the end-to-end test runs
`kdtr verify` with CPU Python callables (defined here, spec'd as this file's path) that plant
them on the CPU flash emulation's output.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from kernels_for_tests import correct, cpu  # tests/ is on sys.path (tests/conftest.py)

from kdtr.check.compare import Check, Status, compare, spans
from kdtr.golden.reference import reference
from kdtr.golden.tolerances import resolve
from kdtr.inputs.cases import CaseSpec, build_problem
from kdtr.kernels.caps import Caps
from kdtr.kernels.contract import POISON_F32_BITS

SPEC = CaseSpec(model="kimi-k2", heads=4, prefix_lens=(3, 40, 70), budget=4, page_size=16, kv_dtype="fp32",
                out_dtype="fp32")
"""B = 3 requests of different prefix lengths, T = 5 nodes, H = 4 heads."""


@pytest.fixture(scope="module")
def case():
    p = build_problem(SPEC)[0]
    out, lse = reference(p)
    return p, out, lse


def judge(p, got, want, output="out") -> Check:
    c = compare(got, want, resolve("fp32", "fp32", output), output, depth=p.tree_depth)
    text = json.dumps(c.to_json())
    assert json.dumps(Check.from_json(json.loads(text)).to_json()) == text  # the localisation survives the JSON
    return c


def request0_everywhere(x: np.ndarray) -> np.ndarray:
    """Every request reads request 0's tree, prefix length and query: request 0's result everywhere."""
    y = x.copy()
    y[1:] = x[0]
    return y


def head0_everywhere(x: np.ndarray) -> np.ndarray:
    """Every head uses head 0's query: head 0's result in every head."""
    y = x.copy()
    y[:, :, 1:] = x[:, :, :1]
    return y


def head_major(x: np.ndarray) -> np.ndarray:
    """Rows (t, h) written at h * T + t instead of t * H + h."""
    B, T, H = x.shape[:3]
    return np.stack([x[b].swapaxes(0, 1).reshape(x[b].shape) for b in range(B)])


def test_a_correct_output_names_no_failing_group(case):
    p, out, lse = case
    for got, want, name in ((out.astype(np.float32), out, "out"), (lse.astype(np.float32), lse, "lse")):
        c = judge(p, got, want, name)
        assert c.status is Status.PASS and c.where == ""
        assert c.bad_requests == c.bad_heads == c.bad_nodes == []
        assert len(c.request_ratio) == p.B and len(c.head_ratio) == p.H and max(c.request_ratio) < 1


@pytest.mark.parametrize("name", ["out", "lse"])
def test_every_request_using_request_0_names_the_others(case, name):
    p, out, lse = case
    want = {"out": out, "lse": lse}[name]
    c = judge(p, request0_everywhere(want), want, name)
    assert c.status is Status.FAIL_NUMERIC
    assert c.bad_requests == [1, 2] and c.request_ratio[0] == 0 and min(c.request_ratio[1:]) > 1
    assert c.bad_heads == [0, 1, 2, 3]
    assert c.where.startswith("requests 1-2 of 0-2 (0 right); heads all 4"), c.where


def test_every_head_using_head_0_names_the_others(case):
    p, out, _ = case
    c = judge(p, head0_everywhere(out), out)
    assert c.bad_heads == [1, 2, 3] and c.head_ratio[0] == 0 and min(c.head_ratio[1:]) > 1
    assert c.bad_requests == [0, 1, 2] and c.bad_nodes == list(range(p.T))
    assert c.where.startswith("requests all 3; heads 1-3 of 0-3 (0 right); nodes all 5"), c.where


def test_head_major_rows_fail_everywhere_but_the_rows_that_coincide(case):
    p, out, _ = case
    c = judge(p, head_major(out), out)
    # (t, h) lands where it belongs only where t * H + h == h * T + t: (0, 0) and (T-1, H-1)
    rows = p.B * p.T * p.H
    assert c.bad_requests == [0, 1, 2] and c.bad_heads == [0, 1, 2, 3] and c.bad_nodes == list(range(p.T))
    assert c.where.endswith(f"; {rows - 2 * p.B} of those {rows} (request, node, head) rows fail"), c.where


def test_one_wrong_node_names_its_request_node_and_depth(case):
    p, out, _ = case
    got = out.copy()
    got[1, 3, 2] += 0.5
    c = judge(p, got, out)
    d = int(p.tree_depth[1, 3])
    assert c.bad_requests == [1] and c.bad_heads == [2] and c.bad_nodes == [3]
    assert [k for k, r in c.depth_ratio.items() if r > 1] == [d]
    assert c.where == f"requests 1 of 0-2; heads 2 of 0-3; nodes 3 of 0-4; depths {d} of {spans(c.depth_ratio)}"


def test_unwritten_rows_are_localised_too(case):
    p, out, _ = case
    got = out.astype(np.float32)
    got[2, :, 1].view(np.uint32)[:] = POISON_F32_BITS  # rows (request 2, head 1) never written
    c = judge(p, got, out)
    assert c.status is Status.UNWRITTEN and c.bad_requests == [2] and c.bad_heads == [1]
    assert c.where.startswith("requests 2 of 0-2; heads 1 of 0-3; nodes all 5"), c.where


def test_spans():
    assert spans([5, 0, 1, 2, 7, 8]) == "0-2,5,7-8" and spans([]) == "" and spans([3]) == "3"


# ---- end to end: `kdtr verify` with CPU callables that plant the bug ------------------------------

def bf16_only(fn):
    """The CPU emulation these wrap takes bf16 storage only: other bundles SKIP."""
    fn.kdtr_caps = Caps(kv_dtypes=("bf16",))
    return cpu(fn)


@bf16_only
def request0_kernel(q, kv_cache, block_table, prefix_lens, tree_mask, *, scale, page_size, out_dtype):
    out, lse = correct(q, kv_cache, block_table, prefix_lens, tree_mask, scale=scale, page_size=page_size,
                       out_dtype=out_dtype)
    return request0_everywhere(out), request0_everywhere(lse)


@bf16_only
def head0_kernel(q, kv_cache, block_table, prefix_lens, tree_mask, *, scale, page_size, out_dtype):
    out, lse = correct(q, kv_cache, block_table, prefix_lens, tree_mask, scale=scale, page_size=page_size,
                       out_dtype=out_dtype)
    return head0_everywhere(out), head0_everywhere(lse)


@pytest.mark.parametrize("fn,line", [
    ("request0_kernel", "out and lse failing in requests 1-5 of 0-5 (0 right); heads all 2"),
    ("head0_kernel", "out failing in requests all 6; heads 1 of 0-1; nodes all 5"),
])
def test_verify_prints_which_requests_and_heads_fail(kdtr, small_dir, tmp_path, monkeypatch, fn, line):
    from kdtr.cli import report

    monkeypatch.setattr(report.console(), "width", 80)
    r = kdtr("verify", "-k", f"{Path(__file__)}:{fn}", small_dir, "--json", tmp_path / "r.json")
    assert r.exit_code == 1, r.output
    lines = r.stdout.splitlines()
    assert max(map(len, lines)) <= 80, r.stdout
    six = next(i for i, ln in enumerate(lines) if ln.startswith("  kimi-h2-p0..130"))  # the B = 6 case's detail
    assert line in " ".join(ln.strip() for ln in lines[six:]), r.stdout  # (unfolded where it wrapped at 80)
    rep = json.loads((tmp_path / "r.json").read_text())
    failing = [res for res in rep["results"] if res["status"] == "FAIL_NUMERIC"]
    assert sorted(res["shape"]["B"] for res in failing) == ([6] if fn == "request0_kernel" else [1, 6])
    assert all(c["where"] for res in failing for c in res["checks"])
