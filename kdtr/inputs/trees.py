"""Draft trees: the masks a verify kernel must get right (SPEC section 2, mask layout section 3).

Real DDTree trees come out of a best-first heap over per-depth drafter marginals, so they are in
pop order (parent < child, depth not monotone) and T = budget + 1 is rarely a tile multiple.
Without drafter weights the marginals are synthesised from ``kdtr.rng`` raw bits and quantised
to multiples of 2**-20, so path scores add exactly, ties are exact, and every machine builds the
same tree. Chains, stars, root-only and user-captured JSON trees cover the other shapes.
"""

from __future__ import annotations

import heapq
import json
import math
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np

from kdtr.inputs.presets import DDTREE_PROFILES, DRAFT_DEPTH, TREE_FAMILIES, VOCAB
from kdtr.inputs.problem import MASK_BITS, mask_words as n_mask_words
from kdtr.inputs.rng import Stream

ZIPF_S = 1.1
"""Zipf exponent of the drafter's tail over ranks 2..VOCAB."""
CONFIDENT_AB = (4.0, 0.55)
"""Kumaraswamy(a, b) of a confident round's top-1 probability (stand-in for Beta(4, 0.55))."""
UNCERTAIN_TOP1 = (0.3, 0.6)
"""Uniform range of an uncertain round's top-1 probability."""
BUSHY_TOP1 = (0.06, 0.2)
"""Uniform range of a bushy round's top-1 probability: a drafter unsure from the first token, so
a dozen depth-1 alternatives outscore any two-token path and the first levels are wide."""
MIXED_CONFIDENT = 0.7
"""Probability that a "mixed" round is a confident one."""
QUANTUM = 2.0**20
"""log-probs are rounded to multiples of 1 / QUANTUM."""
P_MIN = 1e-30
"""Probabilities are clamped to at least this before the log."""
_DTYPES = {"parent": np.int32, "depth": np.int32, "draft_logp": np.float64, "ranks": np.int32, "scores": np.float64}


class TreeError(ValueError):
    """A tree, its mask, a tree file or a tree request is invalid (one-line message)."""


@dataclass(frozen=True, eq=False)
class Tree:
    """One draft tree in node order (root = node 0), with what rebuilds it."""

    parent: np.ndarray
    """[T] int32 parent node index; -1 for the root (node 0); parent[i] < i."""
    depth: np.ndarray
    """[T] int32 depth (root 0); the node's token position is P_b + depth."""
    family: str
    """One of presets.TREE_FAMILIES."""
    params: dict = field(default_factory=dict)
    """JSON-able keyword arguments of make_tree that rebuild this tree."""
    draft_logp: np.ndarray | None = None
    """[L, K] float64 drafter log-probs per depth, non-increasing in rank (DDTree only)."""
    ranks: np.ndarray | None = None
    """[T, L] int32 rank tuple of each node, -1 padded; root all -1 (DDTree only)."""
    scores: np.ndarray | None = None
    """[T] float64 path log-prob; root 0.0; non-increasing in node order (DDTree only)."""

    def __post_init__(self):
        if self.family not in TREE_FAMILIES:
            raise TreeError(f"unknown tree family {self.family!r}; known: {', '.join(TREE_FAMILIES)}")
        check_tree(self.parent, self.depth)
        for name, dt in _DTYPES.items():
            a = getattr(self, name)
            if a is not None:
                a = np.array(a, dtype=dt)  # own copy: trees are shared and cached, so read-only
                a.flags.writeable = False
                object.__setattr__(self, name, a)

    @property
    def T(self) -> int:
        return int(self.parent.shape[0])

    def mask_words(self) -> np.ndarray:
        """[T, ceil(T/32)] uint32 packed ancestor-or-self mask."""
        return pack_mask(self.parent)


# ---------------------------------------------------------------- structure and masks


def _parents(parent) -> np.ndarray:
    """[T] int64 copy of parent after checking root at 0 and 0 <= parent[i] < i."""
    p = np.asarray(parent)
    if p.ndim != 1 or p.shape[0] < 1:
        raise TreeError(f"parent must be a non-empty 1-d array, got shape {list(p.shape)}")
    if p.dtype.kind not in "iu":
        raise TreeError(f"parent must hold integers, got dtype {p.dtype}")
    p = p.astype(np.int64)
    if p[0] != -1:
        raise TreeError(f"node 0 must be the root (parent -1), got parent {int(p[0])}")
    bad = np.nonzero((p[1:] < 0) | (p[1:] >= np.arange(1, p.shape[0])))[0]
    if bad.size:
        i = int(bad[0]) + 1
        if p[i] == -1:
            raise TreeError(f"node {i} has parent -1: only node 0 may be the root")
        raise TreeError(f"node {i} has parent {int(p[i])}: need 0 <= parent < {i} (topological order)")
    return p


def depths(parent) -> np.ndarray:
    """[T] int32 depth of each node (root 0)."""
    p = _parents(parent).tolist()
    d = [0] * len(p)
    for i in range(1, len(p)):
        d[i] = d[p[i]] + 1
    return np.asarray(d, dtype=np.int32)


def pack_mask(parent) -> np.ndarray:
    """[T, ceil(T/32)] uint32: bit c%32 of word c//32 in row r set iff node r sees node c."""
    p = _parents(parent)
    T = p.shape[0]
    words = np.zeros((T, n_mask_words(T)), dtype=np.uint32)
    for i in range(T):
        if i:
            words[i] = words[p[i]]  # row of node i = row of its parent | bit i
        words[i, i // MASK_BITS] |= np.uint32(1 << (i % MASK_BITS))
    return words


def unpack_mask(words, T: int) -> np.ndarray:
    """[T, T] bool from [T, ceil(T/32)] uint32 packed rows (padding bits ignored)."""
    w = np.ascontiguousarray(np.asarray(words, dtype="<u4"))
    if w.shape != (T, n_mask_words(T)):
        raise TreeError(f"mask must be [{T}, {n_mask_words(T)}] words, got {list(w.shape)}")
    bits = np.unpackbits(w.view(np.uint8), axis=1, bitorder="little")  # [T, 32 W]
    return bits[:, :T].astype(bool)


def visible_matrix(parent) -> np.ndarray:
    """[T, T] bool: vis[r, c] iff node c is an ancestor of node r or r itself."""
    p = _parents(parent)
    T = p.shape[0]
    vis = np.zeros((T, T), dtype=bool)
    for i in range(T):
        if i:
            vis[i] = vis[p[i]]
        vis[i, i] = True
    return vis


def check_tree(parent, depth=None, mask_words=None) -> None:
    """Raise TreeError unless parent is a valid tree and depth / mask_words agree with it."""
    d = depths(parent)
    T = d.shape[0]
    if depth is not None:
        got = np.asarray(depth)
        if got.shape != (T,):
            raise TreeError(f"depth must have shape [{T}], got {list(got.shape)}")
        bad = np.nonzero(got != d)[0]
        if bad.size:
            i = int(bad[0])
            raise TreeError(f"depth[{i}] = {int(got[i])} but the parents give {int(d[i])}")
    if mask_words is not None:
        got = np.asarray(mask_words)
        want = pack_mask(parent)
        if got.shape != want.shape:
            raise TreeError(f"mask must be [{T}, {want.shape[1]}] words, got {list(got.shape)}")
        bad = np.nonzero((got.astype(np.uint64) != want).any(axis=1))[0]
        if bad.size:
            r = int(bad[0])
            g = np.unpackbits(got[r : r + 1].astype("<u4").view(np.uint8), bitorder="little")
            w = np.unpackbits(want[r : r + 1].view(np.uint8), bitorder="little")
            extra, missing = _few(np.nonzero(g & ~w)[0]), _few(np.nonzero(w & ~g)[0])
            raise TreeError(f"mask row {r} disagrees with the parents: extra bits {extra}, missing {missing}")


def _few(idx: np.ndarray, n: int = 8) -> str:
    """'[3, 9]' or '[1, 2, ..., 8, ...(+40)]': a short list for one-line messages."""
    head = ", ".join(str(int(i)) for i in idx[:n])
    return f"[{head}, ...(+{idx.size - n})]" if idx.size > n else f"[{head}]"


def leaf_count(parent) -> int:
    """Nodes without children (the root of a 1-node tree is a leaf)."""
    p = _parents(parent)
    return int(p.shape[0] - np.unique(p[1:]).size)


def depth_histogram(depth) -> dict[int, int]:
    """{depth: node count}, depths ascending."""
    vals, counts = np.unique(np.asarray(depth), return_counts=True)
    return {int(v): int(c) for v, c in zip(vals, counts)}


# ---------------------------------------------------------------- synthetic drafter + DDTree


@lru_cache(maxsize=None)
def _zipf_norm() -> float:
    """sum_{r=2..VOCAB} r**-s, summed exactly-rounded (fsum) so it is order-independent."""
    return math.fsum((np.arange(2, VOCAB + 1, dtype=np.float64) ** -ZIPF_S).tolist())


def round_profile(seed: int, round_index: int, profile: str) -> str:
    """The profile a round really uses: "mixed" resolves to confident or uncertain per round."""
    if profile not in DDTREE_PROFILES:
        raise TreeError(f"unknown DDTree profile {profile!r}; known: {', '.join(DDTREE_PROFILES)}")
    if profile != "mixed":
        return profile
    u = Stream(seed, "draft", round_index, "mixed").uniform(1)[0]
    return "confident" if u < MIXED_CONFIDENT else "uncertain"


def synth_logp(seed: int, round_index: int, budget: int, profile: str, L: int = DRAFT_DEPTH) -> np.ndarray:
    """[L, K] float64 synthetic drafter log-probs per depth, K = min(budget, VOCAB).

    Rows are non-increasing in rank and multiples of 2**-20. The top-1 draw does not depend on
    the budget and the tail is normalised over the full vocabulary, so a smaller budget's tree
    is the first nodes of a larger budget's tree for the same (seed, round).
    """
    kind = round_profile(seed, round_index, profile)
    if budget < 0 or L < 1:
        raise TreeError(f"need budget >= 0 and L >= 1, got budget {budget}, L {L}")
    K = min(budget, VOCAB)
    u = Stream(seed, "draft", round_index, "top1").uniform(L)  # [L]
    if kind == "confident":
        a, b = CONFIDENT_AB
        p1 = (1.0 - (1.0 - u) ** (1.0 / b)) ** (1.0 / a)  # Kumaraswamy inverse CDF
    else:
        lo, hi = BUSHY_TOP1 if kind == "bushy" else UNCERTAIN_TOP1
        p1 = lo + (hi - lo) * u
    zipf = np.arange(2, K + 1, dtype=np.float64) ** -ZIPF_S / _zipf_norm()  # [K-1]
    p = np.concatenate([p1[:, None], (1.0 - p1)[:, None] * zipf[None, :]], axis=1)[:, :K]  # [L, K]
    p = -np.sort(-np.maximum(p, P_MIN), axis=1)
    return np.round(np.log(p) * QUANTUM) / QUANTUM


def ddtree(draft_logp: np.ndarray, budget: int, params: dict | None = None) -> Tree:
    """DDTree's best-first heap (SPEC section 2): the `budget` most probable prefixes, pop order."""
    lp = np.asarray(draft_logp, dtype=np.float64)
    if lp.ndim != 2:
        raise TreeError(f"draft_logp must be [L, K], got shape {list(lp.shape)}")
    L, K = lp.shape
    if budget < 0:
        raise TreeError(f"budget must be >= 0, got {budget}")
    if budget and (L < 1 or K < 1):
        raise TreeError(f"draft_logp [{L}, {K}] has no prefixes for budget {budget}")
    if not np.isfinite(lp).all() or (lp > 0).any() or (np.diff(lp, axis=1) > 0).any():
        raise TreeError("draft_logp must be finite, <= 0 and non-increasing in rank")
    rows = lp.tolist()
    parent, depth, score, ranks = [-1], [0], [0.0], [()]
    heap = [(-rows[0][0], (0,), 0)] if budget else []  # (-score, rank tuple, parent node)
    while len(parent) <= budget:
        if not heap:
            raise TreeError(f"budget {budget} exceeds the {len(parent) - 1} prefixes of [{L}, {K}] logp")
        neg, rk, par = heapq.heappop(heap)  # ties on score pop the smaller rank tuple first
        node, d, r = len(parent), len(rk), rk[-1]
        parent.append(par)
        depth.append(d)
        score.append(-neg)
        ranks.append(rk)
        if r + 1 < K:
            heapq.heappush(heap, (-(score[par] + rows[d - 1][r + 1]), rk[:-1] + (r + 1,), par))
        if d < L:
            heapq.heappush(heap, (neg - rows[d][0], rk + (0,), node))
    rank_arr = np.full((len(parent), L), -1, dtype=np.int32)  # [T, L]
    for i, rk in enumerate(ranks):
        rank_arr[i, : len(rk)] = rk
    return Tree(
        parent=np.asarray(parent, dtype=np.int32),
        depth=np.asarray(depth, dtype=np.int32),
        family="ddtree",
        params=dict(params) if params is not None else {"budget": budget},
        draft_logp=lp.copy(),
        ranks=rank_arr,
        scores=np.asarray(score, dtype=np.float64),
    )


def ddtree_from_seed(seed: int, round_index: int, budget: int, profile: str) -> Tree:
    """DDTree over synthetic marginals of (seed, round); params rebuild it via make_tree."""
    params = {"budget": budget, "seed": seed, "round_index": round_index, "profile": profile}
    return ddtree(synth_logp(seed, round_index, budget, profile), budget, params=params)


# ---------------------------------------------------------------- other families and files


def from_parents(parent, family: str = "json", params: dict | None = None) -> Tree:
    """A Tree from a parent array (validated; depth computed)."""
    p = _parents(parent)
    return Tree(parent=p.astype(np.int32), depth=depths(p), family=family, params=dict(params or {}))


def chain(T: int) -> Tree:
    """Linear speculation: parent[i] = i - 1, mask = causal."""
    if T < 1:
        raise TreeError(f"a chain needs T >= 1, got {T}")
    return from_parents(np.arange(-1, T - 1), family="chain", params={"budget": T - 1})


def star(T: int) -> Tree:
    """Every non-root node is a child of the root."""
    if T < 1:
        raise TreeError(f"a star needs T >= 1, got {T}")
    parent = np.zeros(T, dtype=np.int64)
    parent[0] = -1
    return from_parents(parent, family="star", params={"budget": T - 1})


def root_only() -> Tree:
    """T = 1: plain decode."""
    return from_parents([-1], family="root", params={"budget": 0})


def _tree_entry(item, where: str) -> list[int]:
    """The parent list of one JSON tree entry (a list, or a dict with "parent")."""
    if isinstance(item, dict):
        if "parent" not in item:
            raise TreeError(f"{where}: object has no \"parent\" key (keys: {sorted(item)})")
        item = item["parent"]
    if not isinstance(item, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in item):
        raise TreeError(f"{where}: parent must be a list of integers")
    return item


PACKAGE_REF = "kdtr:"
"""Prefix of a tree file named relative to the installed package (``kdtr:data/captured_trees.json``):
what bundles record for the package's own files, so that goldens carry no machine's path."""
PACKAGE_DIR = Path(__file__).resolve().parents[1]
"""The kdtr package folder that PACKAGE_REF names are relative to."""


def tree_file_ref(path) -> str:
    """How a tree file is recorded: ``kdtr:REL`` for a file inside the package, else the path as given."""
    text = str(path)
    if text.startswith(PACKAGE_REF):
        return text
    try:
        rel = Path(text).resolve().relative_to(PACKAGE_DIR)
    except (ValueError, OSError):
        return text
    return PACKAGE_REF + rel.as_posix()


def tree_file_path(ref) -> Path:
    """The file a recorded reference names (``kdtr:REL`` resolved inside the package)."""
    text = str(ref)
    if not text.startswith(PACKAGE_REF):
        return Path(text)
    rel = Path(text[len(PACKAGE_REF):])
    if rel.is_absolute() or ".." in rel.parts or not rel.parts:
        raise TreeError(f"{text}: a {PACKAGE_REF} reference names a file inside the kdtr package, e.g. "
                        f"{PACKAGE_REF}data/captured_trees.json")
    return PACKAGE_DIR / rel


def load_json(path) -> list[Tree]:
    """Trees from [[-1,0,...], ...], {"trees": [[...], ...]} or {"trees": [{"parent": [...]}, ...]}.

    ``path`` may be a ``kdtr:`` package reference (tree_file_path); trees record it as given."""
    try:
        doc = json.loads(tree_file_path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TreeError(f"{path}: cannot read JSON tree file: {e}") from None
    items = doc.get("trees") if isinstance(doc, dict) else doc
    if not isinstance(items, list):
        raise TreeError(f"{path}: expected a list of trees or {{\"trees\": [...]}}")
    trees = []
    for i, item in enumerate(items):
        where = f"{path}: tree {i}"
        try:
            parent = _tree_entry(item, where)
            params = {"budget": len(parent) - 1, "json_path": tree_file_ref(path), "json_index": i}
            trees.append(from_parents(parent, family="json", params=params))
        except TreeError as e:
            raise TreeError(str(e) if str(e).startswith(where) else f"{where}: {e}") from None
    return trees


def save_json(path, trees) -> None:
    """Write trees as {"trees": [{"parent": [...], "family": ..., "params": {...}}, ...]}."""
    doc = {"trees": [{"parent": t.parent.tolist(), "family": t.family, "params": t.params} for t in trees]}
    Path(path).write_text(json.dumps(doc) + "\n")


def make_tree(
    family: str,
    *,
    budget: int,
    seed: int = 0,
    round_index: int = 0,
    profile: str = "mixed",
    json_path: str | None = None,
    json_index: int = 0,
) -> Tree:
    """One tree of any family; T = budget + 1 except "root" (T = 1) and "json" (the file's)."""
    if family not in TREE_FAMILIES:
        raise TreeError(f"unknown tree family {family!r}; known: {', '.join(TREE_FAMILIES)}")
    if family != "root" and family != "json" and budget < 0:
        raise TreeError(f"budget must be >= 0, got {budget}")
    if family == "ddtree":
        return ddtree_from_seed(seed, round_index, budget, profile)
    if family == "chain":
        return chain(budget + 1)
    if family == "star":
        return star(budget + 1)
    if family == "root":
        return root_only()
    if json_path is None:
        raise TreeError("family 'json' needs json_path (a JSON file of parent arrays)")
    trees = load_json(json_path)
    if not 0 <= json_index < len(trees):
        raise TreeError(f"{json_path}: tree index {json_index} out of range (file has {len(trees)})")
    return trees[json_index]
