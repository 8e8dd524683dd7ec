"""emulate-flash: a correct bf16 flash kernel passes the calibrated tolerances with bf16-like
(not zero) error, splits really happen, and every planted bug a plain run can see fails at least one
problem (the baked-lengths bug, planted in the launch, is the correct run here: its proof is under --graph).

Measured figures are printed (``pytest -rP`` or ``-s`` shows them) for tolerance calibration.
"""

from __future__ import annotations

from functools import lru_cache

import ml_dtypes
import numpy as np
import pytest

from kdtr.golden import tolerances
from kdtr.kernels.bugs import PLAIN, Bug
from kdtr.inputs.cases import CaseSpec, build_problem
from kdtr.check.compare import Status, compare
from kdtr.kernels.emulate import default_split_len, emulate_flash, split_bounds
from kdtr.inputs.presets import DK, DV
from kdtr.golden.reference import reference
from kdtr.inputs.trees import unpack_mask

EDGES = (0, 1, 63, 64, 65, 700)
CASES = {
    # DeepSeek TP8: prefix edges around the 64-key tile / page, real DDTree masks.
    "dsv3-edges": CaseSpec(heads=16, prefix_lens=EDGES, budget=16),
    # SGLang token pool (page 1), chain (causal) trees.
    "dsv3-edges-pg1-chain": CaseSpec(heads=16, prefix_lens=EDGES, family="chain", budget=16, page_size=1),
    # Kimi TP8, a prefix long enough for 4 prefix splits plus the tail split.
    "kimi-long": CaseSpec(model="kimi-k2", heads=8, prefix_lens=(2500,), budget=64),
    # Plain decode (T = 1), page 1.
    "dsv3-decode-pg1": CaseSpec(heads=16, prefix_lens=(1, 64, 700, 2500), budget=0, page_size=1),
    # Star: every node but the root is a leaf whose only ancestor is the root.
    "dsv3-star": CaseSpec(heads=16, prefix_lens=(65, 300), family="star", budget=16),
    # No prefix: the tail is the only split.
    "dsv3-p0": CaseSpec(heads=16, prefix_lens=(0,), budget=16),
    # T = 32: each mask row ends exactly on a word boundary.
    "dsv3-t32": CaseSpec(heads=2, prefix_lens=(0, 100, 65), budget=31),
    # Scores of std ~36, past +-88: exp(s) overflows in fp32 without the running max.
    "dsv3-hot": CaseSpec(heads=4, prefix_lens=(65, 700), budget=16, scale=1.5),
}

# Bug -> the problems it must fail on, and why.
BUG_CASES = {
    # ddtree pop order: node t-1 is often a sibling/cousin, not t's parent; in a star every node
    # t >= 2 gains a full-weight sibling key. (In a chain t-1 is the parent: a no-op, tested below.)
    Bug.SIBLING_VISIBLE: ("dsv3-edges", "dsv3-star", "dsv3-p0"),
    # The P=1 request's root loses half of its two keys; decode P=1 loses its only prefix key.
    Bug.DROP_PREFIX_KEY: ("dsv3-edges", "dsv3-edges-pg1-chain", "dsv3-decode-pg1"),
    # P=63 loses its whole prefix, P=65 one key, P=700 60 keys.
    Bug.DROP_PARTIAL_TILE: ("dsv3-edges", "dsv3-edges-pg1-chain", "dsv3-decode-pg1", "dsv3-star"),
    # Logits have std ~3 here: +1% sharpens every softmax (lse moves by ~1%, ~70x its tolerance).
    Bug.SCALE_OFF: tuple(CASES),
    # The 64 RoPE columns carry ~1/9 of q.k's variance: every score moves by ~1.
    Bug.NO_ROPE: tuple(CASES),
    # kimi-long merges 4 prefix splits + the tail; dsv3-edges merges prefix + tail per request;
    # dsv3-p0 has one split only, so the bug plants a 2-way split of the tail.
    Bug.MERGE_WRONG_MAX: ("kimi-long", "dsv3-edges", "dsv3-p0"),
    # page 64: the P=63 request's key 63 comes from page 1 offset 63, an unowned NaN slot;
    # page 1: every key is its successor, the last one on the NaN spare page.
    Bug.PAGE_OFF_BY_ONE: ("dsv3-edges", "dsv3-edges-pg1-chain", "dsv3-decode-pg1"),
    # T = 32: rows t >= 1 read row 2 t's word, and the next request's.
    Bug.MASK_STRIDE: ("dsv3-t32",),
    # Node c reads bit 31 - c: nodes 0..16 read bits no node of T = 17 sets but 15 and 16.
    Bug.MASK_BIT_ORDER: ("dsv3-edges", "dsv3-edges-pg1-chain", "dsv3-p0", "dsv3-t32"),
    # A ddtree or star node sees every earlier node, siblings and cousins too.
    Bug.CAUSAL_MASK: ("dsv3-edges", "dsv3-star", "dsv3-p0", "dsv3-t32"),
    # Each request of dsv3-edges draws its own tree.
    Bug.MASK_REQUEST0: ("dsv3-edges", "dsv3-t32"),
    # A node loses its own key, its largest weight in a shallow tree; the root at P=0 sees nothing.
    Bug.NO_SELF: ("dsv3-edges", "dsv3-star", "dsv3-p0"),
    # Row (t, h) takes another node's or head's query.
    Bug.Q_HEAD_MAJOR: ("dsv3-edges", "kimi-long", "dsv3-star", "dsv3-t32"),
    # Requests b >= 1 read another request's pages (or NaN entries past them).
    Bug.BLOCK_TABLE_STRIDE: ("dsv3-edges", "dsv3-edges-pg1-chain", "dsv3-decode-pg1"),
    # The tail keys are the prefix's first T keys.
    Bug.TAIL_POSITION: ("dsv3-edges", "kimi-long", "dsv3-star"),
    # exp(s) overflows to inf, then NaN.
    Bug.NO_RUNNING_MAX: ("dsv3-hot",),
    # lse x 1.44, and the merge weights partials by exp of base-2 lse.
    Bug.LSE_LOG2: tuple(CASES),
    # Half an ulp toward zero on average: the rounding-bias check (bf16 out).
    Bug.OUT_TRUNCATE: ("dsv3-edges", "kimi-long", "dsv3-decode-pg1", "dsv3-star"),
    # The operator at scale * 0.69: every softmax flattens.
    Bug.MISSING_LOG2E: tuple(CASES),
    # V's columns 64..575: every output column moves.
    Bug.V_COLUMNS: tuple(CASES),
}
SHOWS_IN = {Bug.V_COLUMNS: ("out",), Bug.OUT_TRUNCATE: ("out",), Bug.LSE_LOG2: ("lse",)}
"""The outputs a bug changes where it is not every output (lse has no V, no bf16 rounding; one split's out
needs no lse)."""


@lru_cache(maxsize=None)
def case(name: str):
    """(problem, ref_out, ref_lse) of a named case, built once."""
    p, _ = build_problem(CASES[name])
    ro, rl = reference(p)
    return p, ro, rl


@lru_cache(maxsize=None)
def run(name: str, out_dtype: str = "bf16", bug: Bug = Bug.NONE, split_len: int | None = None):
    p, _, _ = case(name)
    return emulate_flash(p, out_dtype, bug, split_len=split_len)


def check(name: str, out_dtype: str = "bf16", bug: Bug = Bug.NONE, split_len: int | None = None):
    """(out Check, lse Check) against the fp64 reference with the table's bf16-storage tolerances."""
    p, ro, rl = case(name)
    o, l = run(name, out_dtype, bug, split_len)
    co = compare(o, ro, tolerances.default("bf16", out_dtype, "out"), "out", depth=p.tree_depth, out_dtype=out_dtype)
    cl = compare(l, rl, tolerances.default("bf16", out_dtype, "lse"), "lse", depth=p.tree_depth)
    return co, cl


def fig(c) -> str:
    return f"{c.output} {c.status.value} max_abs={c.max_abs:.3g} ratio={c.ratio:.3g} rel_norm={c.rel_norm:.3g}"


@pytest.mark.parametrize("out_dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("name", list(CASES))
def test_correct_kernel_passes(name, out_dtype):
    co, cl = check(name, out_dtype)
    msg = f"{name} out_dtype={out_dtype}: {fig(co)} | {fig(cl)}"
    print(msg)
    assert co.status is Status.PASS, msg + " " + co.message
    assert cl.status is Status.PASS, msg + " " + cl.message


@pytest.mark.parametrize("name", ["dsv3-edges", "kimi-long", "dsv3-decode-pg1"])
def test_error_is_bf16_like_not_zero(name):
    """fp32 out still carries the bf16 P rounding: relative norm well above fp32 noise."""
    co, _ = check(name, "fp32")
    assert 1e-5 < co.rel_norm < 1e-2, fig(co)


def test_bf16_out_holds_bf16_values():
    o, _ = run("dsv3-edges", "bf16")
    assert o.dtype == np.float32
    np.testing.assert_array_equal(o, o.astype(ml_dtypes.bfloat16).astype(np.float32))
    o32, _ = run("dsv3-edges", "fp32")
    assert not np.array_equal(o, o32)


def test_refuses_fp32_storage_and_bad_arguments():
    p, _ = build_problem(CaseSpec(heads=2, prefix_lens=(3,), budget=2, kv_dtype="fp32", out_dtype="fp32"))
    with pytest.raises(ValueError, match="bf16"):
        emulate_flash(p, "fp32")
    pb, _, _ = case("dsv3-p0")
    with pytest.raises(ValueError):
        emulate_flash(pb, "fp16")
    with pytest.raises(ValueError):
        emulate_flash(pb, split_len=100)  # not a multiple of the 64-key tile


def test_split_bounds():
    assert default_split_len(2500) == 640
    assert split_bounds(2500, 640) == [(0, 640), (640, 1280), (1280, 1920), (1920, 2500)]
    assert split_bounds(700, default_split_len(700)) == [(0, 700)]
    assert split_bounds(0, default_split_len(0)) == []
    assert split_bounds(1, default_split_len(1)) == [(0, 1)]
    assert len(split_bounds(131072, default_split_len(131072))) == 16
    for P in (1, 63, 64, 65, 511, 512, 1025, 2500, 8192, 32768, 131072):
        sl = default_split_len(P)
        b = split_bounds(P, sl)
        assert sl % 64 == 0 and b[0][0] == 0 and b[-1][1] == P
        assert all(s1 == t0 for (_, s1), (t0, _) in zip(b, b[1:]))
        assert all(0 < s1 - s0 <= sl for s0, s1 in b)
    with pytest.raises(ValueError):
        split_bounds(100, 96)


def test_split_len_changes_arithmetic_not_result():
    """Many splits, one split, default: all pass, and the bf16 rounding really differs."""
    outs = {}
    for sl in (64, None, 2560):
        co, cl = check("kimi-long", "fp32", split_len=sl)
        assert co.status is Status.PASS and cl.status is Status.PASS, f"split_len={sl}: {fig(co)} {fig(cl)}"
        outs[sl] = run("kimi-long", "fp32", split_len=sl)[0]
    assert not np.array_equal(outs[64], outs[None])
    assert not np.array_equal(outs[None], outs[2560])


def tile_loop(p, b: int, split_len: int, tile: int = 64, round_p: bool = True):
    """Independent oracle: the GPU's literal per-tile online softmax of request b, fp32.

    Returns out [T, H, 512] and lse [T, H] (out not rounded to an output dtype).
    """
    T, H = p.T, p.H
    R, P = T * H, int(p.prefix_lens[b])
    kv = p.kv_cache.reshape(-1, DK)[p.tokens(b)].astype(np.float32)  # [P+T, 576]
    q = p.q[b].reshape(R, DK).astype(np.float32)  # [R, 576]
    vis = np.ones((R, P + T), dtype=bool)
    vis[:, P:] = np.repeat(unpack_mask(p.tree_mask[b], T), H, axis=0)
    outs, lses = [], []
    for s0, s1 in split_bounds(P, split_len, tile) + [(P, P + T)]:
        m = np.full(R, -np.inf, np.float32)
        l = np.zeros(R, np.float32)
        acc = np.zeros((R, DV), np.float32)
        for t0 in range(s0, s1, tile):
            t1 = min(s1, t0 + tile)
            s = (q @ kv[t0:t1].T) * np.float32(p.scale)
            s = np.where(vis[:, t0:t1], s, np.float32(-np.inf))
            m_new = np.maximum(m, s.max(axis=1))
            ms = np.where(np.isneginf(m_new), np.float32(0), m_new)
            pr = np.exp(s - ms[:, None])
            alpha = np.exp(m - ms)
            l = l * alpha + pr.sum(axis=1)
            if round_p:
                pr = pr.astype(ml_dtypes.bfloat16).astype(np.float32)
            acc = acc * alpha[:, None] + pr @ kv[t0:t1, :DV]
            m = m_new
        outs.append(acc / l[:, None])
        lses.append(m + np.log(l))
    lse_s = np.stack(lses)  # [S, R]
    M = lse_s.max(axis=0)
    w = np.exp(lse_s - M)
    out = (w[:, :, None] * np.stack(outs)).sum(axis=0) / w.sum(axis=0)[:, None]
    return out.reshape(T, H, DV), (M + np.log(w.sum(axis=0))).reshape(T, H)


@pytest.mark.parametrize("name, b", [("dsv3-edges", 5), ("dsv3-edges", 2), ("kimi-long", 0)])
def test_matches_literal_tile_loop(name, b):
    """The folded rescale equals the per-tile loop to fp32 rounding, far below the bf16 error (2^-8).

    fp32 rounding here depends on the CPU's BLAS kernels: OpenBLAS's FMA kernels (Haswell, Zen) put
    the two up to 4.8e-6 x scale apart on these cases, its SSE ones (Sandybridge) 8e-7; the loop
    with a wrong rescale factor (sqrt(alpha)) is 0.24-0.36 x scale off on the two multi-tile cases."""
    p, ro, rl = case(name)
    sl = default_split_len(int(p.prefix_lens[b]))
    o, l = run(name, "fp32")
    lo, ll = tile_loop(p, b, sl)
    scale = np.abs(ro[b]).max()
    assert np.abs(o[b] - lo).max() < 2e-5 * scale, np.abs(o[b] - lo).max()
    assert np.abs(l[b] - ll).max() < 1e-5
    # Without the P rounding the same loop meets the fp32-kernel tolerance: P is the bf16 error.
    xo, xl = tile_loop(p, b, sl, round_p=False)
    c = compare(xo[None], ro[b : b + 1], tolerances.default("fp32", "fp32", "out"))
    assert c.status is Status.PASS, fig(c)
    assert np.abs(xl - rl[b]).max() < 2e-5


@pytest.mark.parametrize("bug", PLAIN, ids=lambda b: b.slug)
def test_planted_bug_fails(bug):
    lines = []
    for name in BUG_CASES[bug]:
        co, cl = check(name, "bf16", bug)
        ok, _ = check(name, "bf16")
        lines.append(f"{bug.slug} on {name}: {fig(co)} | {fig(cl)} (correct ratio {ok.ratio:.3g})")
        shows = SHOWS_IN.get(bug, ("out", "lse"))
        for c in (co, cl):
            if c.output in shows:
                assert c.status in (Status.FAIL_NUMERIC, Status.NAN), lines[-1]
        if co.status is Status.FAIL_NUMERIC and bug is not Bug.OUT_TRUNCATE:  # well beyond the correct kernel's
            assert co.ratio > 2.5 * ok.ratio, lines[-1]  # (truncation: inside every element's bound, a bias)
    print("\n".join(lines))


def test_bugs_are_noops_where_their_definition_says():
    """Exact definitions: no effect where the bug's condition never holds."""
    base = run("dsv3-edges-pg1-chain", "fp32")[0]
    # A chain's node t-1 is its parent: SIBLING_VISIBLE adds nothing.
    np.testing.assert_array_equal(run("dsv3-edges-pg1-chain", "fp32", Bug.SIBLING_VISIBLE)[0], base)
    # Request 0 has P=0 (nothing to drop); request 3 has P=64 (no partial tile).
    for bug, b in ((Bug.DROP_PREFIX_KEY, 0), (Bug.DROP_PARTIAL_TILE, 0), (Bug.DROP_PARTIAL_TILE, 3)):
        np.testing.assert_array_equal(run("dsv3-edges-pg1-chain", "fp32", bug)[0][b], base[b])
    # Page 64, P=0, T=17: tokens 0..16 never reach (j + 1) % 64 == 0.
    np.testing.assert_array_equal(run("dsv3-p0", "fp32", Bug.PAGE_OFF_BY_ONE)[0], run("dsv3-p0", "fp32")[0])
    # T = 17: the stride of 17 + 1 nodes is one word too; a chain's causal mask is its own.
    for bug in (Bug.MASK_STRIDE, Bug.CAUSAL_MASK):
        np.testing.assert_array_equal(run("dsv3-edges-pg1-chain", "fp32", bug)[0], base)
    # Request 0 reads its own mask and block-table row; P = 0 puts the tail where it is.
    for bug in (Bug.MASK_REQUEST0, Bug.BLOCK_TABLE_STRIDE, Bug.TAIL_POSITION):
        np.testing.assert_array_equal(run("dsv3-edges-pg1-chain", "fp32", bug)[0][0], base[0])
    # T = 1: row (0, h) is row h of either layout; fp32 out is not truncated.
    dec = run("dsv3-decode-pg1", "fp32")
    for bug in (Bug.Q_HEAD_MAJOR, Bug.OUT_TRUNCATE):
        np.testing.assert_array_equal(run("dsv3-decode-pg1", "fp32", bug)[0], dec[0])
    # One split (P = 0): lse in base 2 leaves out alone.
    np.testing.assert_array_equal(run("dsv3-p0", "fp32", Bug.LSE_LOG2)[0], run("dsv3-p0", "fp32")[0])


def test_truncated_out_is_the_correct_one_rounded_toward_zero():
    """One split (P = 0): OUT_TRUNCATE stores the correct fp32 result rounded toward zero, never away."""
    exact = run("dsv3-p0", "fp32")[0]
    got = run("dsv3-p0", "bf16", Bug.OUT_TRUNCATE)[0]
    np.testing.assert_array_equal(got, (exact.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32))
    assert (np.abs(got) <= np.abs(run("dsv3-p0", "bf16")[0])).all()


def test_baked_lengths_is_a_launch_bug_a_plain_run_cannot_see():
    """Prepared and run on the same lengths (a plain run), the baked-lengths variant is the correct kernel bit
    for bit; its bug lives in the plan a capture freezes (tests/check/test_graph_capture.py fails it under --graph)."""
    from kdtr.kernels.emulate import HostBuffers, prepare_emulation

    for name in ("dsv3-edges", "kimi-long"):
        o, l = run(name, "bf16", Bug.BAKED_LENGTHS)
        ro, rl = run(name, "bf16")
        assert o.tobytes() == ro.tobytes() and l.tobytes() == rl.tobytes()
    p, _, _ = case("dsv3-edges")
    buffers = HostBuffers(p, "bf16")
    assert prepare_emulation(buffers, "bf16", Bug.BAKED_LENGTHS).baked_lens == tuple(EDGES)
    assert prepare_emulation(buffers, "bf16").baked_lens is None  # the correct plan reads the buffers every run


def test_a_mock_replay_on_the_capture_s_own_inputs_is_the_plain_run():
    from kdtr.kernels.emulate import capture_emulation

    p, _, _ = case("dsv3-star")
    for bug in (Bug.NONE, Bug.BAKED_LENGTHS, Bug.SCALE_OFF):
        runner = capture_emulation("emulate-flash", p, "bf16", bug)
        got = runner.replay()
        o, l = run("dsv3-star", "bf16", bug)
        assert got.out.tobytes() == o.tobytes() and got.lse.tobytes() == l.tobytes(), bug
