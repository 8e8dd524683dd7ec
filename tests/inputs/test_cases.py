"""Case specs, names and the serving layout they expand to."""

import hashlib

import numpy as np
import pytest

from kdtr.inputs import suites
from kdtr.inputs.cases import CaseSpec, build_problem
from kdtr.inputs.presets import BUDGETS, DDTREE_PROFILES, DK, DV, PAGE_SIZES, prefix_edges


def test_layout_is_paged_shuffled_and_nan_elsewhere():
    spec = CaseSpec(prefix_lens=(0, 63, 64, 65, 130), budget=16, page_size=64, heads=2)
    p, _ = build_problem(spec)
    flat = p.kv_cache.reshape(-1, DK)
    owned = np.zeros(flat.shape[0], dtype=bool)
    for b in range(p.B):
        slots = p.tokens(b)
        assert not np.isnan(flat[slots].astype(np.float32)).any(), "a live row holds NaN"
        owned[slots] = True
    assert np.isnan(flat[~owned].astype(np.float32)).all(), "a slot no request owns is not NaN"
    used = [p.block_table[b, : -(-(int(p.prefix_lens[b]) + p.T) // 64)] for b in range(p.B)]
    allp = np.concatenate(used)
    assert len(set(allp.tolist())) == len(allp), "two requests share a page"
    assert not np.array_equal(allp, np.sort(allp)), "pages are not shuffled"
    pad = p.block_table[0, len(used[0]):]  # request 0 needs one page; the rest of its row is padding
    assert len(pad) and np.isnan(p.kv_cache[pad].astype(np.float32)).all(), "padding must point at a NaN page"


def test_same_seed_same_bytes_other_seed_other_bytes():
    spec = CaseSpec(prefix_lens=(5, 70), budget=16, heads=2, page_size=1)
    a, _ = build_problem(spec)
    b, _ = build_problem(spec)
    c, _ = build_problem(CaseSpec(prefix_lens=(5, 70), budget=16, heads=2, page_size=1, seed=1))
    for name in ("q", "kv_cache", "block_table", "tree_parent", "tree_mask"):
        assert getattr(a, name).tobytes() == getattr(b, name).tobytes()
    assert a.q.tobytes() != c.q.tobytes()


def test_inputs_are_pinned_across_versions():
    """The bytes of a small case are pinned: a numpy or platform change that alters them fails here."""
    p, _ = build_problem(CaseSpec(prefix_lens=(3,), budget=4, heads=1, page_size=4, kv_dtype="bf16"))
    h = hashlib.sha256()
    for a in (p.q, p.kv_cache, p.block_table, p.tree_parent, p.tree_mask):
        h.update(np.ascontiguousarray(a).tobytes())
    assert h.hexdigest() == PINNED


PINNED = "b1820f0424a9902745d407f65cfe2b4421dc985fe1c79df9504968ffd404de49"


def test_names_are_unique_and_parameter_derived():
    for name, fn in suites.SUITES.items():
        names = [s.name for s in fn()]
        assert len(names) == len(set(names)), name
    s = CaseSpec(model="kimi-k2", heads=8, prefix_lens=(8192, 3), budget=256, profile="confident", page_size=1,
                 kv_dtype="bf16", out_dtype="fp32", seed=7)
    assert s.name == "kimi-h8-p8k.3-ddtree256c-pg1-bf16ofp32-s7"
    assert CaseSpec.from_json(s.to_json()) == s


def test_ci_suite_covers_every_edge():
    ci = suites.ci()
    assert {s.T for s in ci} >= {b + 1 for b in BUDGETS}
    assert {s.family for s in ci} >= {"ddtree", "chain", "star", "root", "json"}
    assert {s.page_size for s in ci} == set(PAGE_SIZES)
    assert {(s.kv_dtype, s.out_dtype) for s in ci} == {("fp32", "fp32"), ("bf16", "bf16"), ("bf16", "fp32"), ("fp32", "bf16")}
    assert {s.profile for s in ci if s.family == "ddtree"} == set(DDTREE_PROFILES)
    assert {31, 32, 33, 64} <= {s.T for s in ci}, "T at and around the 32-bit mask-word edges"
    assert {s.budget for s in ci if s.profile == "bushy"} >= {16, 31, 63}, "bushy trees at budgets 16-64"
    assert {(s.kv_dtype, s.out_dtype) for s in ci if s.values == "hard"} == {("fp32", "fp32"), ("bf16", "bf16"),
                                                                             ("bf16", "fp32")}
    prefixes = {p for s in ci for p in s.prefix_lens}
    assert set(prefix_edges(64)) <= prefixes
    assert any(len(set(s.prefix_lens)) > 1 for s in ci), "no mixed-length batch"
    assert any(s.H == 16 and s.T > 1 for s in ci), "no full TP8 DeepSeek head count on a tree"
    assert sum(s.nbytes_estimate() for s in ci) < 29.5e6


@pytest.mark.parametrize("bad", [
    dict(model="llama"), dict(kv_dtype="fp16"), dict(family="bush"), dict(profile="sure"),
    dict(prefix_lens=()), dict(prefix_lens=(-1,)), dict(heads=0), dict(family="json"),
])
def test_bad_specs_are_refused(bad):
    with pytest.raises(ValueError):
        CaseSpec(**bad)


def test_names_stay_short_for_big_batches():
    equal = CaseSpec(prefix_lens=(32768,) * 32)
    mixed = CaseSpec(prefix_lens=tuple(range(121)))
    assert "p32kx32" in equal.name and len(mixed.name) < 80
    assert CaseSpec(prefix_lens=tuple(range(121))).name == mixed.name != CaseSpec(prefix_lens=tuple(range(1, 122))).name


def test_capacity_gives_cases_of_other_lengths_the_same_buffers():
    """A capacity sizes the block table and the cache (as a server's captured buffers), whatever the lengths;
    every slot no request owns stays NaN, and the name says so."""
    a, _ = build_problem(CaseSpec(prefix_lens=(0, 63, 100), budget=16, heads=1, page_size=16, capacity=150))
    b, _ = build_problem(CaseSpec(prefix_lens=(133, 1, 64), budget=16, heads=1, page_size=16, capacity=150))
    for name in ("q", "kv_cache", "block_table", "prefix_lens", "tree_mask"):
        assert getattr(a, name).shape == getattr(b, name).shape, name
    assert a.block_table.shape == (3, 10) and a.kv_cache.shape == (3 * 10 + 1, 16, DK)
    flat = b.kv_cache.reshape(-1, DK)
    owned = np.zeros(flat.shape[0], dtype=bool)
    for r in range(b.B):
        owned[b.tokens(r)] = True
        need = -(-(int(b.prefix_lens[r]) + b.T) // 16)
        assert np.isnan(b.kv_cache[b.block_table[r, need:]].astype(np.float32)).all()  # padding: the NaN page
    assert not np.isnan(flat[owned].astype(np.float32)).any() and np.isnan(flat[~owned].astype(np.float32)).all()
    spec = CaseSpec(prefix_lens=(133, 1, 64), budget=16, heads=1, page_size=16, capacity=2048)
    assert spec.name == "dsv3-h1-p133.1.64-ddtree16m-pg16-cap2k-bf16-s0"
    assert CaseSpec.from_json(spec.to_json()) == spec and spec.to_json()["capacity"] == 2048


def test_no_capacity_keeps_the_tight_layout_and_the_json_of_older_bundles():
    spec = CaseSpec(prefix_lens=(0, 63, 100), budget=16, heads=1, page_size=16)
    assert "capacity" not in spec.to_json() and "cap" not in spec.name
    assert CaseSpec.from_json(spec.to_json()) == spec
    p, _ = build_problem(spec)
    assert p.block_table.shape == (3, 8) and p.kv_cache.shape[0] == 2 + 5 + 8 + 1
    with pytest.raises(ValueError, match="capacity 100 is below"):
        CaseSpec(prefix_lens=(90,), budget=16, capacity=100)


# ---------------------------------------------------------------- "hard" values


def _scores(p, b):
    """[T, H, P_b + T] scaled scores of request b in float64, NaN where not visible."""
    from kdtr.inputs.trees import unpack_mask

    P = int(p.prefix_lens[b])
    s = np.einsum("thd,jd->thj", p.q[b].astype(np.float64) * p.scale, p.gather_kv(b, 0, P + p.T))
    vis = np.ones((p.T, P + p.T), dtype=bool)
    vis[:, P:] = unpack_mask(p.tree_mask[b], p.T)
    return np.where(vis[:, None, :], s, np.nan)


@pytest.mark.parametrize("spec", [s for s in suites.ci() if s.values == "hard"], ids=lambda s: s.name)
def test_hard_ci_cases_reach_scores_past_100_with_near_ties(spec):
    p, _ = build_problem(spec)
    for b in range(p.B):
        s = _scores(p, b)
        assert np.nanmax(s) >= 100, (b, np.nanmax(s))  # past fp32 exp's overflow at 88.7
        if p.prefix_lens[b] >= 3:  # anti-aligned prefix keys
            assert np.nanmin(s) <= -100, (b, np.nanmin(s))
        if s.shape[2] >= 8:
            top = -np.sort(-np.nan_to_num(s, nan=-np.inf), axis=2)[..., :2]  # [T, H, 2]
            assert np.median(top[..., 0] - top[..., 1]) < 5, "the largest scores should nearly tie"
            for h in range(1, p.H):  # a kernel that reads head 0's query for every head is far off
                assert np.nanmean(np.abs(s[:, h] - s[:, 0])) > 2


def test_hard_values_differ_per_request_and_head_and_keep_the_value_scale():
    spec = CaseSpec(model="kimi-k2", heads=4, prefix_lens=(100, 100, 100), budget=8, values="hard")
    p, _ = build_problem(spec)
    v_means = [p.gather_kv(b, 0, 100)[:, :DV].mean() for b in range(p.B)]
    assert min(abs(a - b) for i, a in enumerate(v_means) for b in v_means[i + 1:]) > 0.05, v_means
    assert all(0.2 < abs(m) < 0.8 for m in v_means)  # the per-request offset
    q_rms = np.sqrt((p.q[..., :DV].astype(np.float64) ** 2).mean(axis=(1, 3)))  # [B, H]
    assert np.ptp(q_rms) > 0.2 and len(np.unique(np.round(q_rms, 3))) == q_rms.size
    v = np.concatenate([p.gather_kv(b, 0, 108)[:, :DV] for b in range(p.B)])
    assert np.abs(v).max() < 2 * np.sqrt(3) + 0.8, "the value columns keep unit variance plus the offset"
    normal, _ = build_problem(CaseSpec(model="kimi-k2", heads=4, prefix_lens=(100, 100, 100), budget=8))
    assert np.nanmax(np.abs(_scores(normal, 0))) < 20


def test_values_is_recorded_named_and_absent_at_its_default():
    hard = CaseSpec(prefix_lens=(5,), budget=4, heads=1, values="hard")
    assert hard.name == "dsv3-h1-p5-ddtree4m-pg64-bf16-hard-s0" and hard.to_json()["values"] == "hard"
    assert CaseSpec.from_json(hard.to_json()) == hard
    normal = CaseSpec(prefix_lens=(5,), budget=4, heads=1)
    assert "values" not in normal.to_json() and "hard" not in normal.name
    assert CaseSpec.from_json(normal.to_json()).values == "normal"
    with pytest.raises(ValueError, match="unknown values"):
        CaseSpec(values="spiky")


def test_hard_inputs_are_deterministic_and_pinned():
    spec = CaseSpec(prefix_lens=(3, 70), budget=4, heads=2, page_size=4, values="hard")
    a, _ = build_problem(spec)
    b, _ = build_problem(spec)
    h = hashlib.sha256()
    for x, y in ((a.q, b.q), (a.kv_cache, b.kv_cache)):
        assert x.tobytes() == y.tobytes()
        h.update(np.ascontiguousarray(x).tobytes())
    assert h.hexdigest() == PINNED_HARD
    c, _ = build_problem(CaseSpec(prefix_lens=(3, 70), budget=4, heads=2, page_size=4, values="hard", seed=1))
    assert a.q.tobytes() != c.q.tobytes()


PINNED_HARD = "226241af531b6472df974d47e3ebbf688c0bfe3ce65b51d6d0a0adc91d9839a9"
