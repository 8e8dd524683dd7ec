"""kdtr.trees: DDTree's heap is exact, masks match parents, bad trees and files are rejected."""

from __future__ import annotations

import itertools
import json
import time

import numpy as np
import pytest

from kdtr.inputs import presets
from kdtr.inputs import trees as tr
from kdtr.inputs.rng import Stream

BUDGETS = (0, 1, 16, 64, 256, 1024)
SEEDS = (0, 7)


def naive_visible(parent) -> np.ndarray:
    """[T, T] bool by walking each node's ancestor chain (independent of the packers)."""
    T = len(parent)
    vis = np.zeros((T, T), dtype=bool)
    for r in range(T):
        c = r
        while c != -1:
            vis[r, c] = True
            c = int(parent[c])
    return vis


def brute_force_order(logp: np.ndarray) -> list[tuple[int, ...]]:
    """Every rank-tuple prefix of [L, K] logp, sorted by (-score, rank tuple)."""
    L, K = logp.shape
    items = []
    for d in range(1, L + 1):
        for rk in itertools.product(range(K), repeat=d):
            items.append((-sum(logp[i, r] for i, r in enumerate(rk)), rk))
    return [rk for _, rk in sorted(items)]


def rank_tuples(t: tr.Tree) -> list[tuple[int, ...]]:
    return [tuple(int(x) for x in row if x >= 0) for row in t.ranks]


def quantised_logp(seed: int, L: int, K: int, step: float) -> np.ndarray:
    """[L, K] random non-increasing logp on a grid of `step` (coarse steps force ties)."""
    u = Stream(seed, "test-logp").uniform((L, K))
    lp = -np.sort(np.round(u * 4.0 / step) * step, axis=1)
    return lp


# ---------------------------------------------------------------- invariants of every tree


def all_trees():
    for prof in presets.DDTREE_PROFILES:
        for seed in SEEDS:
            for b in BUDGETS:
                yield f"ddtree-{prof}-s{seed}-b{b}", tr.make_tree("ddtree", budget=b, seed=seed, profile=prof)
    for b in (0, 1, 32, 64, 1024):
        yield f"chain-b{b}", tr.make_tree("chain", budget=b)
        yield f"star-b{b}", tr.make_tree("star", budget=b)
    yield "root", tr.make_tree("root", budget=99)


TREES = dict(all_trees())


@pytest.mark.parametrize("name", list(TREES))
def test_tree_invariants(name):
    t = TREES[name]
    p, d = t.parent, t.depth
    assert p.dtype == np.int32 and d.dtype == np.int32 and p.shape == d.shape == (t.T,)
    if t.family != "root":
        assert t.T == t.params["budget"] + 1
    assert p[0] == -1 and all(0 <= p[i] < i for i in range(1, t.T))
    assert np.array_equal(d[1:], d[p[1:]] + 1) and d[0] == 0
    words = t.mask_words()
    assert words.dtype == np.uint32 and words.shape == (t.T, -(-t.T // 32))
    popcount = np.unpackbits(words.view(np.uint8), axis=1).sum(axis=1)
    assert np.array_equal(popcount, d + 1)
    vis = tr.unpack_mask(words, t.T)
    assert np.array_equal(vis, tr.visible_matrix(p))
    if t.T <= 300:
        assert np.array_equal(vis, naive_visible(p))
    tr.check_tree(p, d, words)


@pytest.mark.parametrize("name", [n for n in TREES if n.startswith("ddtree")])
def test_ddtree_structure(name):
    t = TREES[name]
    L, K = t.draft_logp.shape
    assert (L, K) == (presets.DRAFT_DEPTH, min(t.params["budget"], presets.VOCAB))
    assert np.all(np.diff(t.scores) <= 0), "scores must never increase in pop order"
    rks = rank_tuples(t)
    assert rks[0] == () and len(set(rks)) == t.T
    for i in range(1, t.T):
        assert rks[i][:-1] == rks[t.parent[i]], f"node {i} is not an extension of its parent"
        assert len(rks[i]) == t.depth[i] and rks[i][-1] < K
        assert t.scores[i] == sum(t.draft_logp[j, r] for j, r in enumerate(rks[i]))
    for node in range(t.T):
        kids = np.nonzero(t.parent == node)[0]
        assert [rks[k][-1] for k in kids] == list(range(len(kids))), f"children of {node} not a rank prefix"


# ---------------------------------------------------------------- the heap is exact


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("step", [1e-6, 0.5])  # 0.5: a coarse grid, many exact ties
def test_heap_equals_brute_force(seed, step):
    logp = quantised_logp(seed, L=4, K=3, step=step)
    order = brute_force_order(logp)
    assert len(order) == 3 + 9 + 27 + 81
    for budget in (0, 1, 2, 5, 17, 60, len(order)):
        t = tr.ddtree(logp, budget)
        assert rank_tuples(t)[1:] == order[:budget]


def test_ties_follow_rank_tuple_order():
    t = tr.ddtree(np.full((3, 3), -1.0), 6)
    assert rank_tuples(t) == [(), (0,), (1,), (2,), (0, 0), (0, 1), (0, 2)]
    assert t.parent.tolist() == [-1, 0, 0, 0, 1, 1, 1]
    # (0, 0) and (1,) tie at -1: lexicographic order puts (0, 0) first, though it is deeper
    t = tr.ddtree(np.array([[0.0, -1.0], [-1.0, -2.0]]), 3)
    assert rank_tuples(t) == [(), (0,), (0, 0), (1,)]


def test_heap_exhaustion_and_bad_logp():
    with pytest.raises(tr.TreeError, match="exceeds"):
        tr.ddtree(np.full((2, 2), -1.0), 7)
    tr.ddtree(np.full((2, 2), -1.0), 6)
    for bad in ([[-1.0, -0.5]], [[0.5, -1.0]], [[-np.inf, -np.inf]], [-1.0, -2.0]):
        with pytest.raises(tr.TreeError):
            tr.ddtree(np.array(bad), 1)


def test_budget_1024_is_fast_and_nested():
    t0 = time.perf_counter()
    big = tr.ddtree_from_seed(3, 2, 1024, "mixed")
    big.mask_words()
    assert time.perf_counter() - t0 < 0.5
    small = tr.ddtree_from_seed(3, 2, 64, "mixed")
    assert np.array_equal(small.parent, big.parent[:65]), "a smaller budget's tree is a prefix"


# ---------------------------------------------------------------- synthetic marginals


@pytest.mark.parametrize("profile", presets.DDTREE_PROFILES)
def test_synth_logp_shape_quantised_sorted(profile):
    for budget in (0, 1, 5, 300):
        lp = tr.synth_logp(11, 3, budget, profile)
        assert lp.shape == (presets.DRAFT_DEPTH, budget) and lp.dtype == np.float64
        assert np.all(lp * 2**20 == np.round(lp * 2**20)), "not multiples of 2**-20"
        assert np.all(lp <= 0) and np.all(np.diff(lp, axis=1) <= 0)
        if budget:
            assert np.all(np.exp(lp).sum(axis=1) <= 1 + 1e-5)
    assert tr.synth_logp(0, 0, 4, profile, L=3).shape == (3, 4)


def test_synth_logp_independent_of_budget():
    """The tail is the full-vocabulary Zipf tail truncated at K, so budgets share marginals."""
    for profile in presets.DDTREE_PROFILES:
        big = tr.synth_logp(9, 4, 1024, profile)
        assert np.array_equal(tr.synth_logp(9, 4, 64, profile), big[:, :64])
        p = np.exp(big)
        assert np.all(p.sum(axis=1) < 1 - 0.1 * (1 - p[:, 0])), "tail mass beyond K must stay implied"


def test_uncertain_top1_range():
    for s in range(20):
        p1 = np.exp(tr.synth_logp(s, 0, 4, "uncertain")[:, 0])
        assert np.all((p1 > 0.3 - 1e-5) & (p1 < 0.6 + 1e-5))


def test_determinism():
    a, b = tr.ddtree_from_seed(5, 1, 256, "mixed"), tr.ddtree_from_seed(5, 1, 256, "mixed")
    for f in ("parent", "depth", "draft_logp", "ranks", "scores"):
        assert getattr(a, f).tobytes() == getattr(b, f).tobytes()
    c = tr.ddtree_from_seed(6, 1, 256, "mixed")
    d = tr.ddtree_from_seed(5, 2, 256, "mixed")
    assert not np.array_equal(a.draft_logp, c.draft_logp) and not np.array_equal(a.parent, c.parent)
    assert not np.array_equal(a.draft_logp, d.draft_logp)


def test_profiles_differ():
    def mean_max_depth(profile):
        return np.mean([tr.ddtree_from_seed(s, 0, 64, profile).depth.max() for s in range(20)])

    conf, unc = mean_max_depth("confident"), mean_max_depth("uncertain")
    assert conf > unc + 2, (conf, unc)
    widths = [np.bincount(tr.ddtree_from_seed(s, 0, 64, p).depth).max() for p in ("confident", "uncertain") for s in range(10)]
    assert np.mean(widths[10:]) > np.mean(widths[:10]), "uncertain trees should be wider"


def test_mixed_chooses_per_round():
    picks = []
    for r in range(200):
        prof = tr.round_profile(1, r, "mixed")
        assert np.array_equal(tr.synth_logp(1, r, 8, "mixed"), tr.synth_logp(1, r, 8, prof))
        picks.append(prof == "confident")
    assert 0.55 < np.mean(picks) < 0.85


# ---------------------------------------------------------------- masks and check_tree


@pytest.mark.parametrize("T", [1, 31, 32, 33, 65, 257, 1025])
def test_masks_odd_sizes(T):
    c, s = tr.chain(T), tr.star(T)
    assert c.T == s.T == T and c.mask_words().shape == (T, (T + 31) // 32)
    assert np.array_equal(tr.unpack_mask(c.mask_words(), T), np.tril(np.ones((T, T), bool)))
    want = np.eye(T, dtype=bool)
    want[:, 0] = True
    assert np.array_equal(tr.unpack_mask(s.mask_words(), T), want)
    if T > 1:
        last = c.mask_words()[T - 1]
        assert last[(T - 1) // 32] >> np.uint32((T - 1) % 32) == 1, "no bit beyond the last node"


def test_pack_mask_known_words():
    words = tr.pack_mask([-1, 0, 0, 1])
    assert words[:, 0].tolist() == [0b1, 0b11, 0b101, 0b1011]
    w = tr.pack_mask(np.arange(-1, 40))
    assert w[39].tolist() == [0xFFFFFFFF, 0xFF] and w[31].tolist() == [0xFFFFFFFF, 0]


def test_pack_mask_fast_at_1025():
    t0 = time.perf_counter()
    tr.pack_mask(np.arange(-1, 1024))
    assert time.perf_counter() - t0 < 0.2


@pytest.mark.parametrize(
    "parent, match",
    [
        ([-1, 0, -1, 1], "node 2 has parent -1"),
        ([-1, 0, 2, 1], "node 2 has parent 2"),
        ([-1, 0, 3, 1], "node 2 has parent 3"),
        ([0, 0, 1], "node 0 must be the root"),
        ([], "non-empty"),
        ([[-1, 0]], "1-d"),
        ([-1.0, 0.0], "integers"),
    ],
)
def test_check_tree_rejects_parents(parent, match):
    with pytest.raises(tr.TreeError, match=match):
        tr.check_tree(np.array(parent))


def test_check_tree_rejects_depth_and_mask():
    t = tr.ddtree_from_seed(2, 0, 64, "confident")
    tr.check_tree(t.parent, t.depth, t.mask_words())
    depth = t.depth.copy()
    depth[9] += 1
    with pytest.raises(tr.TreeError, match=r"depth\[9\]"):
        tr.check_tree(t.parent, depth)
    with pytest.raises(tr.TreeError, match="shape"):
        tr.check_tree(t.parent, depth[:-1])
    words = t.mask_words().copy()
    sib = int(np.nonzero(t.parent == t.parent[12])[0][0])  # a sibling (or 12 itself) of node 12
    other = sib if sib != 12 else int(np.nonzero(t.depth == t.depth[12])[0][-1])
    assert not tr.visible_matrix(t.parent)[12, other]
    words[12, other // 32] |= np.uint32(1 << (other % 32))
    words[20, 0] &= np.uint32(0xFFFFFFFE)  # a later row missing the root: row 12 must be reported
    with pytest.raises(tr.TreeError, match=rf"mask row 12 .*extra bits \[{other}\]"):
        tr.check_tree(t.parent, None, words)
    words = t.mask_words().copy()
    words[3, 2] |= np.uint32(1 << 31)  # padding bit beyond T = 65
    with pytest.raises(tr.TreeError, match="mask row 3"):
        tr.check_tree(t.parent, mask_words=words)
    words = t.mask_words().copy()
    words[40] = 0xFFFFFFFF
    with pytest.raises(tr.TreeError, match=r"mask row 40 .*\(\+\d+\)\], missing \[\]") as e:
        tr.check_tree(t.parent, mask_words=words)
    assert len(str(e.value)) < 160
    with pytest.raises(tr.TreeError, match="mask must be"):
        tr.check_tree(t.parent, mask_words=words[:, :2])


def test_leaf_count_and_histogram():
    assert tr.leaf_count([-1]) == 1 and tr.leaf_count(tr.chain(5).parent) == 1
    assert tr.leaf_count(tr.star(5).parent) == 4 and tr.leaf_count([-1, 0, 0, 1, 1, 2]) == 3
    assert tr.depth_histogram(tr.depths([-1, 0, 0, 1, 1, 2])) == {0: 1, 1: 2, 2: 3}
    assert tr.depth_histogram(tr.chain(4).depth) == {0: 1, 1: 1, 2: 1, 3: 1}


def test_tree_is_read_only_copy():
    parent = np.array([-1, 0, 0])
    t = tr.Tree(parent=parent, depth=np.array([0, 1, 1]), family="json")
    parent[2] = 1
    assert t.parent.tolist() == [-1, 0, 0] and t.parent.dtype == np.int32
    with pytest.raises(ValueError):
        t.parent[1] = 0
    with pytest.raises(tr.TreeError, match="depth"):
        tr.Tree(parent=np.array([-1, 0, 1]), depth=np.array([0, 1, 1]), family="json")
    with pytest.raises(tr.TreeError, match="unknown tree family"):
        tr.Tree(parent=np.array([-1]), depth=np.array([0]), family="bush")


# ---------------------------------------------------------------- families, dispatch, JSON


def test_make_tree_dispatch():
    for fam in ("ddtree", "chain", "star", "root"):
        assert tr.make_tree(fam, budget=0).T == 1
    assert tr.make_tree("root", budget=64).T == 1
    assert tr.make_tree("star", budget=5).parent.tolist() == [-1, 0, 0, 0, 0, 0]
    t = tr.make_tree("ddtree", budget=64, seed=4, round_index=3, profile="uncertain")
    again = tr.make_tree(t.family, **t.params)
    assert np.array_equal(t.parent, again.parent) and json.loads(json.dumps(t.params)) == t.params
    with pytest.raises(tr.TreeError, match="known: ddtree, chain"):
        tr.make_tree("bushy", budget=4)
    with pytest.raises(tr.TreeError, match="known: confident"):
        tr.make_tree("ddtree", budget=4, profile="wild")
    with pytest.raises(tr.TreeError, match="json_path"):
        tr.make_tree("json", budget=4)
    with pytest.raises(tr.TreeError, match="budget"):
        tr.make_tree("chain", budget=-1)


def test_json_round_trip(tmp_path):
    trees = [tr.ddtree_from_seed(1, 0, 40, "mixed"), tr.chain(33), tr.root_only(), tr.star(3)]
    path = tmp_path / "trees.json"
    tr.save_json(path, trees)
    back = tr.load_json(path)
    assert [b.parent.tolist() for b in back] == [t.parent.tolist() for t in trees]
    assert all(b.family == "json" and np.array_equal(b.depth, t.depth) for b, t in zip(back, trees))
    t = tr.make_tree("json", budget=0, json_path=str(path), json_index=1)
    assert t.T == 33 and np.array_equal(tr.make_tree("json", **t.params).parent, t.parent)
    with pytest.raises(tr.TreeError, match="out of range"):
        tr.make_tree("json", budget=0, json_path=str(path), json_index=4)


@pytest.mark.parametrize("doc", [[[-1, 0, 0, 1], [-1]], {"trees": [[-1, 0, 0, 1], [-1]]},
                                 {"trees": [{"parent": [-1, 0, 0, 1]}, {"parent": [-1]}]}])
def test_json_accepted_layouts(tmp_path, doc):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(doc))
    assert [t.parent.tolist() for t in tr.load_json(path)] == [[-1, 0, 0, 1], [-1]]


@pytest.mark.parametrize(
    "text, match",
    [
        ("{not json", "cannot read"),
        ('{"roots": []}', "expected a list"),
        ('"hello"', "expected a list"),
        ('[[-1, 0], [-1, -1]]', "tree 1: node 1 has parent -1"),
        ('[[-1, 0], [-1, 2]]', "tree 1: node 1 has parent 2"),
        ('{"trees": [{"parents": [-1]}]}', "tree 0: object has no \"parent\""),
        ('[[-1, 0.5]]', "tree 0: parent must be a list of integers"),
        ('[[-1, true]]', "tree 0: parent must be a list of integers"),
        ('[[]]', "tree 0: parent must be a non-empty"),
        ('[[0]]', "tree 0: node 0 must be the root"),
    ],
)
def test_json_rejects(tmp_path, text, match):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(tr.TreeError, match=match) as e:
        tr.load_json(path)
    assert "bad.json" in str(e.value) and "\n" not in str(e.value)


def test_json_missing_file(tmp_path):
    with pytest.raises(tr.TreeError, match="nope.json"):
        tr.load_json(tmp_path / "nope.json")


def test_package_references_name_files_inside_the_package(tmp_path):
    """Bundles record the package's own tree files as kdtr:REL, never a machine's path (issue 37, defect 1)."""
    sample = tr.PACKAGE_DIR / "data" / "captured_trees.json"
    assert tr.tree_file_ref(sample) == "kdtr:data/captured_trees.json"
    assert tr.tree_file_ref("kdtr:data/captured_trees.json") == "kdtr:data/captured_trees.json"
    assert tr.tree_file_path("kdtr:data/captured_trees.json") == sample
    elsewhere = tmp_path / "mine.json"
    tr.save_json(elsewhere, [tr.chain(3)])
    assert tr.tree_file_ref(elsewhere) == str(elsewhere) and tr.tree_file_ref("rel/mine.json") == "rel/mine.json"
    t = tr.make_tree("json", budget=0, json_path=str(sample), json_index=2)
    assert t.params["json_path"] == "kdtr:data/captured_trees.json"
    assert np.array_equal(tr.make_tree("json", **t.params).parent, t.parent)
    for bad in ("kdtr:../README.md", "kdtr:/etc/passwd", "kdtr:"):
        with pytest.raises(tr.TreeError, match="inside the kdtr package"):
            tr.load_json(bad)


@pytest.mark.parametrize("budget", [16, 31, 48, 63, 64])
def test_bushy_trees_have_wide_first_levels(budget):
    """The "bushy" profile: a drafter unsure from the first token, so DDTree spends most of the budget on
    depth-1 alternatives (the ci trees of the other profiles are chains plus a branch at budget 16)."""
    for r in range(4):
        t = tr.make_tree("ddtree", budget=budget, seed=r, round_index=r, profile="bushy")
        hist = tr.depth_histogram(t.depth)
        assert hist[1] >= budget // 2 and max(hist) >= 2, hist
        assert tr.leaf_count(t.parent) >= budget // 2
        tr.check_tree(t.parent, t.depth, t.mask_words())
        p1 = np.exp(t.draft_logp[:, 0])
        assert np.all((p1 > tr.BUSHY_TOP1[0] - 1e-5) & (p1 < tr.BUSHY_TOP1[1] + 1e-5))
    chainy = tr.make_tree("ddtree", budget=16, round_index=0, profile="confident")
    assert tr.depth_histogram(chainy.depth)[1] <= 2
