"""Tests that would catch a wrong oracle."""

import math

import numpy as np
import pytest

from kdtr.inputs.cases import CaseSpec, build_problem
from kdtr.inputs.presets import DV
from kdtr.golden.reference import reference
from kdtr.inputs.trees import unpack_mask


def _problem(**kw):
    base = dict(model="deepseek-v3", heads=2, prefix_lens=(0, 7), budget=4, page_size=4, kv_dtype="fp32", out_dtype="fp32")
    base.update(kw)
    return build_problem(CaseSpec(**base))[0]


def brute_force(p):
    """Per-element loops over rows and keys, plain Python floats, no chunking, no masking tricks."""
    out = np.zeros((p.B, p.T, p.H, DV))
    lse = np.zeros((p.B, p.T, p.H))
    for b in range(p.B):
        P = int(p.prefix_lens[b])
        keys = p.gather_kv(b, 0, P + p.T)
        vis = unpack_mask(p.tree_mask[b], p.T)
        for t in range(p.T):
            for h in range(p.H):
                q = p.q[b, t, h].astype(np.float64)
                idx = [j for j in range(P + p.T) if j < P or vis[t, j - P]]
                s = [p.scale * float(np.dot(q, keys[j])) for j in idx]
                m = max(s)
                w = [math.exp(x - m) for x in s]
                l = sum(w)
                out[b, t, h] = sum(wi * keys[j, :DV] for wi, j in zip(w, idx)) / l
                lse[b, t, h] = m + math.log(l)
    return out, lse


@pytest.mark.parametrize("kw", [
    dict(),
    dict(family="chain", budget=6, page_size=1),
    dict(family="star", budget=5, prefix_lens=(3,), kv_dtype="bf16"),
    dict(family="root", budget=0, prefix_lens=(0, 1, 9)),
    dict(budget=40, prefix_lens=(70,), heads=1),  # T = 41: mask spans two words
])
def test_matches_brute_force(kw):
    p = _problem(**kw)
    out, lse = reference(p)
    bo, bl = brute_force(p)
    np.testing.assert_allclose(out, bo, rtol=1e-11, atol=1e-13)
    np.testing.assert_allclose(lse, bl, rtol=1e-12, atol=1e-12)


def test_chunking_does_not_change_the_result():
    p = _problem(prefix_lens=(1000, 333), heads=3, budget=16)
    a = reference(p)
    b = reference(p, chunk=256)  # several chunks, a ragged last one
    for x, y in zip(a, b):
        np.testing.assert_allclose(x, y, rtol=1e-12, atol=1e-14)


def test_single_visible_key_returns_its_value():
    p = _problem(family="root", budget=0, prefix_lens=(0,))  # P = 0, T = 1: the root sees only itself
    out, lse = reference(p)
    v = p.gather_kv(0, 0, 1)[0]
    np.testing.assert_array_equal(out[0, 0, 0], v[:DV])
    assert lse[0, 0, 0] == pytest.approx(p.scale * float(p.q[0, 0, 0].astype(np.float64) @ v), rel=1e-14)


def test_equal_scores_return_the_mean_of_visible_values():
    p = _problem(family="chain", budget=3, prefix_lens=(5,))
    p.q[:] = 0  # every score is 0: weights are uniform over the visible keys
    out, lse = reference(p)
    keys = p.gather_kv(0, 0, 5 + 4)
    for t in range(4):  # node t sees the prefix and chain nodes 0..t
        want = keys[: 5 + t + 1, :DV].mean(axis=0)
        np.testing.assert_allclose(out[0, t, 0], want, rtol=1e-13, atol=1e-15)
        assert lse[0, t, 0] == pytest.approx(math.log(5 + t + 1), rel=1e-14)


def test_huge_logits_neither_overflow_nor_lose_the_row():
    p = _problem(prefix_lens=(20,), budget=4)
    p.scale = 400.0  # |s| reaches ~1e4 and beyond
    out, lse = reference(p)
    assert np.isfinite(out).all() and np.isfinite(lse).all()
    assert np.abs(lse).max() > 1e3
    keys = p.gather_kv(0, 0, 25)
    vis = unpack_mask(p.tree_mask[0], 5)
    for t in range(5):  # the softmax is one-hot on the best visible key
        idx = [j for j in range(25) if j < 20 or vis[t, j - 20]]
        s = [float(p.q[0, t, 0].astype(np.float64) @ keys[j]) for j in idx]
        best = idx[int(np.argmax(s))]
        np.testing.assert_allclose(out[0, t, 0], keys[best, :DV], rtol=1e-9, atol=1e-9)


def test_invisible_keys_never_change_a_row():
    p = _problem(prefix_lens=(9,), budget=12, heads=2)
    base_out, base_lse = reference(p)
    vis = unpack_mask(p.tree_mask[0], p.T)
    for c in range(1, p.T):  # perturb tail key c, check every row that cannot see it
        q = _problem(prefix_lens=(9,), budget=12, heads=2)
        slot = q.tokens(0)[9 + c]
        q.kv_cache.reshape(-1, q.kv_cache.shape[-1])[slot] *= -3.0
        o, l = reference(q)
        blind = ~vis[:, c]
        assert blind.any() or c == 0
        np.testing.assert_array_equal(o[0, blind], base_out[0, blind])
        np.testing.assert_array_equal(l[0, blind], base_lse[0, blind])
        assert not np.array_equal(o[0, vis[:, c]], base_out[0, vis[:, c]])  # and those who see it do change


def test_nan_in_unowned_slots_never_reaches_an_output():
    p = _problem(prefix_lens=(1, 6), budget=4, page_size=4)
    assert np.isnan(p.kv_cache).any()  # the layout really holds NaN next to live rows
    out, lse = reference(p)
    assert np.isfinite(out).all() and np.isfinite(lse).all()


def test_p_zero_and_t_one():
    p = _problem(family="root", budget=0, prefix_lens=(0, 0))
    out, lse = reference(p)
    assert out.shape == (2, 1, 2, DV) and lse.shape == (2, 1, 2)
    np.testing.assert_array_equal(out[1, 0, 1], p.gather_kv(1, 0, 1)[0, :DV])
