"""Case specifications and the inputs they expand to.

A ``CaseSpec`` is a handful of parameters; its name is derived from them (attention-gym
style), so the name is the test id, the file name and the table label. ``build_problem``
turns a spec into the arrays a server would hand the kernel: a shuffled paged cache with
NaN in every slot no request owns, a block table, per-request DDTree trees.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field

import numpy as np

from kdtr.inputs import presets, trees
from kdtr.inputs.presets import DK, DV
from kdtr.inputs.problem import Problem, mask_words
from kdtr.inputs.rng import Stream


@dataclass(frozen=True)
class CaseSpec:
    """Everything that determines one golden case (with the seed, its bytes)."""

    model: str = "deepseek-v3"
    """Model preset (presets.MODELS); gives the scale and the default head count."""
    heads: int = 16
    """Query heads on this GPU (model heads / TP)."""
    prefix_lens: tuple[int, ...] = (64,)
    """Committed prefix length P_b of each request; B = len(prefix_lens)."""
    family: str = "ddtree"
    """Tree family (presets.TREE_FAMILIES)."""
    budget: int = 16
    """Draft budget; T = budget + 1 (0 is plain decode). Ignored by "root"."""
    profile: str = "mixed"
    """DDTree drafter profile (presets.DDTREE_PROFILES)."""
    page_size: int = 64
    """Tokens per cache page (1: SGLang token pool, 64: FlashMLA)."""
    kv_dtype: str = "bf16"
    """Storage dtype of q and the cache."""
    out_dtype: str = "bf16"
    """Output dtype a kernel writes for this case."""
    seed: int = 0
    """Seed of every random value in the case."""
    json_path: str | None = None
    """Captured trees (family "json"): request b takes tree json_index + b. A file inside the package
    is recorded as ``kdtr:REL`` (kdtr.inputs.trees.tree_file_ref), any other as given."""
    json_index: int = 0
    """First tree used from json_path."""
    scale: float | None = None
    """Override of the model's softmax scale."""
    capacity: int | None = None
    """Tokens per request the block table holds (max_pages = ceil(capacity / page_size), and the cache has
    B * max_pages + 1 pages), so that cases of different lengths share buffer shapes, as a server's
    captured buffers do (kdtr verify --graph). None: as many pages as the longest request needs."""
    values: str = "normal"
    """Value distribution of q and the cache (presets.VALUE_KINDS). "normal": unit-variance values, scaled
    scores within about +-17. "hard" (HardValues): outlier RoPE channels, sink keys, per-request and
    per-head scales and offsets, so scores pass +-100 and every request and head differs visibly."""
    tags: tuple[str, ...] = field(default=(), compare=False)
    """What the case covers (for listings); not part of its identity."""

    def __post_init__(self):
        presets.model(self.model)
        presets.dtype_of(self.kv_dtype)
        presets.dtype_of(self.out_dtype)
        if self.kv_dtype not in presets.DTYPES or self.out_dtype not in presets.DTYPES:
            raise ValueError(f"dtypes must be among {presets.DTYPES}")
        if self.family not in presets.TREE_FAMILIES:
            raise ValueError(f"unknown tree family {self.family!r}; known: {', '.join(presets.TREE_FAMILIES)}")
        if self.values not in presets.VALUE_KINDS:
            raise ValueError(f"unknown values {self.values!r}; known: {', '.join(presets.VALUE_KINDS)}")
        if self.profile not in presets.DDTREE_PROFILES:
            raise ValueError(f"unknown profile {self.profile!r}; known: {', '.join(presets.DDTREE_PROFILES)}")
        if not self.prefix_lens or min(self.prefix_lens) < 0:
            raise ValueError("prefix_lens needs at least one length, each >= 0")
        if self.heads < 1 or self.budget < 0 or self.page_size < 1:
            raise ValueError("heads and page_size must be >= 1 and budget >= 0")
        if self.family == "json" and not self.json_path:
            raise ValueError("family 'json' needs json_path (a JSON file of parent arrays)")
        if self.capacity is not None and self.capacity < max(self.prefix_lens) + self.T:
            raise ValueError(f"capacity {self.capacity} is below the longest request's P + T = "
                             f"{max(self.prefix_lens) + self.T}")
        if self.json_path is not None:  # the package's own files as kdtr:REL, never a machine's path
            object.__setattr__(self, "json_path", trees.tree_file_ref(self.json_path))

    @property
    def B(self) -> int:
        return len(self.prefix_lens)

    @property
    def T(self) -> int:
        return 1 if self.family == "root" else self.budget + 1

    @property
    def H(self) -> int:
        return self.heads

    @property
    def model_scale(self) -> float:
        return self.scale if self.scale is not None else presets.model(self.model).scale

    @property
    def name(self) -> str:
        short = presets.SHORT.get(presets.model(self.model).name, self.model)
        plist = _plist(self.prefix_lens)
        tree = "root" if self.family == "root" else f"{self.family}{self.budget}"
        if self.family == "ddtree":
            tree += f"{self.profile[0]}"
        if self.family == "json":
            tree += f"i{self.json_index}"
        dt = self.kv_dtype if self.out_dtype == self.kv_dtype else f"{self.kv_dtype}o{self.out_dtype}"
        scale = "" if self.scale is None else f"-sc{self.scale:g}"
        cap = "" if self.capacity is None else f"-cap{_size(self.capacity)}"
        vals = "" if self.values == "normal" else f"-{self.values}"
        return f"{short}-h{self.heads}-p{plist}-{tree}-pg{self.page_size}{cap}-{dt}{scale}{vals}-s{self.seed}"

    @property
    def max_pages(self) -> int:
        """Block-table width: the capacity's pages, or the longest request's."""
        tokens = self.capacity if self.capacity is not None else max(self.prefix_lens) + self.T
        return -(-tokens // self.page_size)

    @property
    def num_pages(self) -> int:
        """Cache pages: every request's own (B * max_pages with a capacity) plus one spare all-NaN page."""
        if self.capacity is not None:
            return self.B * self.max_pages + 1
        return sum(-(-(p + self.T) // self.page_size) for p in self.prefix_lens) + 1

    def to_json(self) -> dict:
        d = asdict(self)
        if self.capacity is None:  # absent, not null: bundles made before the field keep their bytes
            del d["capacity"]
        if self.values == "normal":  # absent at its default, for the same reason
            del d["values"]
        d["prefix_lens"] = list(self.prefix_lens)
        d["tags"] = list(self.tags)
        return d

    @classmethod
    def from_json(cls, d: dict) -> "CaseSpec":
        d = dict(d)
        d["prefix_lens"] = tuple(d["prefix_lens"])
        d["tags"] = tuple(d.get("tags", ()))
        return cls(**d)

    def nbytes_estimate(self) -> int:
        """Bytes of the bundle's data region: every tensor as stored (the header adds ~2.5 KB).

        Exact for generated bundles; kdtr.resources estimates the memory it takes to make them.
        """
        es = presets.dtype_of(self.kv_dtype).itemsize
        T, B = self.T, self.B
        rows = B * T * self.H
        cache = self.num_pages * self.page_size * DK * es  # one spare all-NaN page
        ints = B * self.max_pages + B + 2 * B * T + B * T * mask_words(T)  # block table, P, parent, depth, mask
        logp = B * presets.DRAFT_DEPTH * min(self.budget, presets.VOCAB) * 8 if self.family == "ddtree" else 0
        return cache + rows * (DK * es + DV * 4 + 8) + 4 * ints + logp


def _plist(prefix_lens: tuple[int, ...]) -> str:
    """'0.65.8k'; a batch of B equal prefixes 'P x B' ('32kx32'); long mixed lists by range and a hash."""
    ps = list(prefix_lens)
    if len(ps) > 1 and len(set(ps)) == 1:
        return f"{_size(ps[0])}x{len(ps)}"
    if len(ps) <= 6:
        return ".".join(_size(p) for p in ps)
    digest = hashlib.sha256(",".join(map(str, ps)).encode()).hexdigest()[:6]
    return f"{_size(min(ps))}-{_size(max(ps))}n{len(ps)}h{digest}"


def _size(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def build_trees(spec: CaseSpec) -> list[trees.Tree]:
    """One tree per request; DDTree rounds differ per request (round index = b)."""
    return [
        trees.make_tree(
            spec.family,
            budget=spec.budget,
            seed=spec.seed,
            round_index=b,
            profile=spec.profile,
            json_path=spec.json_path,
            json_index=spec.json_index + b,
        )
        for b in range(spec.B)
    ]


def build_problem(spec: CaseSpec, values: bool = True) -> tuple[Problem, list[trees.Tree]]:
    """The inputs of a case: values from raw generator bits, pages shuffled, NaN elsewhere.

    values=False leaves q and the owned cache rows zero (layout only): `kdtr bench` fills them
    with fresh random values on the GPU, which is much faster for 100k-token prefixes.
    """
    tlist = build_trees(spec)
    T, H, B, pg = spec.T, spec.H, spec.B, spec.page_size
    if any(t.T != T for t in tlist):
        raise ValueError(f"{spec.name}: every request's tree must have T = {T} nodes")
    dt = presets.dtype_of(spec.kv_dtype)
    key = spec.name

    shape_q = (B, T, H, DK)
    hard = HardValues(spec) if values and spec.values == "hard" else None
    if not values:
        q = np.zeros(shape_q, dt)
    elif hard is not None:
        q = hard.q(dt)  # [B, T, H, 576]
    else:
        q = Stream(spec.seed, key, "q").normalish(shape_q, dtype=dt)  # [B, T, H, 576]

    n_tok = [p + T for p in spec.prefix_lens]
    n_pages = [-(-n // pg) for n in n_tok]
    owned = sum(n_pages)
    num_pages = spec.num_pages  # owned + one spare page (block-table padding points at it, all NaN)
    perm = Stream(spec.seed, key, "pages").permutation(num_pages)
    kv = np.full((num_pages, pg, DK), np.nan, dtype=dt)  # [num_pages, page_size, 576]
    max_pages = spec.max_pages
    nan_page = int(perm[owned])
    table = np.full((B, max_pages), nan_page, dtype=np.int32)  # [B, max_pages]
    nxt = 0
    for b in range(B):
        pages = perm[nxt : nxt + n_pages[b]]
        nxt += n_pages[b]
        table[b, : n_pages[b]] = pages
        flat = kv[pages].reshape(n_pages[b] * pg, DK)  # NaN; its first P_b + T rows get values
        if not values:
            flat[: n_tok[b]] = 0
        elif hard is not None:
            flat[: n_tok[b]] = hard.kv(b, dt)
        else:
            flat[: n_tok[b]] = Stream(spec.seed, key, "kv", b).normalish((n_tok[b], DK), dtype=dt)
        kv[pages] = flat.reshape(n_pages[b], pg, DK)

    prob = Problem(
        q=q,
        kv_cache=kv,
        block_table=table,
        prefix_lens=np.asarray(spec.prefix_lens, dtype=np.int32),
        tree_parent=np.stack([t.parent for t in tlist]).astype(np.int32),
        tree_depth=np.stack([t.depth for t in tlist]).astype(np.int32),
        tree_mask=np.stack([t.mask_words() for t in tlist]).astype(np.uint32),
        scale=float(spec.model_scale),
    )
    prob.validate()
    return prob, tlist


HARD_CHANNELS = 4
"""RoPE columns that carry outliers in "hard" values (the same columns in q and k, as trained models'
massive activations sit in a few fixed channels)."""
HARD_K = 16.0
"""Outlier magnitude in the keys' outlier columns (a power of two: exact in bf16)."""
HARD_TARGET = (40.0, 130.0)
"""Range of the scaled score a (request, head)'s queries give a sink key; head b % H of request b gets
the top, so every request has rows whose scores pass fp32 exp's overflow at 88.7."""
HARD_SINKS = 3
"""Prefix keys per request that are sinks (key 0 and random others); the root's own key is one too."""
HARD_ANTI = 2
"""Prefix keys per request aligned against the queries (scores near -target)."""
HARD_SPREAD = 0.9
"""Other prefix keys' outlier values: uniform in +-HARD_SPREAD * HARD_K (scores spread over +-0.9 target)."""
HARD_TAIL = 0.9
"""Tree keys' outlier values: uniform in [HARD_TAIL, 1] * HARD_K, so the nodes' own latents tie nearly with
the sinks and a wrong mask still moves the output."""
HARD_OFFSET = (0.25, 0.75)
"""|offset| added to every latent (value) column of a request's cache rows, sign random per request."""


class HardValues:
    """The "hard" value distribution of a case, from the seed alone (Streams named after the case).

    Why: unit-variance values keep every scaled score within about +-17, so a softmax without the running
    max, or fp32 bounds that ignore the score magnitude, go unnoticed. Here a few RoPE columns carry
    outliers of fixed sign in q and of matching sign in a few sink keys (key 0, two random prefix keys, the
    root's key, which every node sees), so scores reach about +-140 with near-ties among the sinks and the
    tree's own keys (within 10 % of a sink); the other prefix keys spread over +-0.9 of that. Each (request,
    head) has its own query scale and sink score and each request its own value offset, so a kernel that
    reads request 0's or head 0's data for all fails on every other one. The value columns (0:512) keep unit
    variance plus the offset, so out keeps its scale. Only basic IEEE operations on Stream values (correctly
    rounded on every machine): the same bytes everywhere.
    """

    def __init__(self, spec: CaseSpec):
        self.spec, self.key = spec, spec.name
        B, H = spec.B, spec.H
        st = Stream(spec.seed, self.key, "hard", "setup")
        self.cols = DV + np.sort(st.permutation(DK - DV)[:HARD_CHANNELS])  # outlier columns in 512:576
        self.sign = np.where(st.uniform(HARD_CHANNELS) < 0.5, -1.0, 1.0)  # [C] preferred sign per column
        lo, hi = HARD_TARGET
        target = lo + (hi - lo) * st.uniform((B, H))  # [B, H] sink score per (request, head)
        target[np.arange(B), np.arange(B) % H] = hi
        self.q_amp = target / (spec.model_scale * HARD_CHANNELS * HARD_K)  # [B, H] q outlier magnitude
        self.q_gain = 0.5 + st.uniform((B, H))  # [B, H] scale of q's other columns
        self.offset = (HARD_OFFSET[0] + (HARD_OFFSET[1] - HARD_OFFSET[0]) * st.uniform(B)) * np.where(
            st.uniform(B) < 0.5, -1.0, 1.0)  # [B] value offset per request

    def q(self, dt) -> np.ndarray:
        """[B, T, H, 576] queries in dtype dt."""
        s = self.spec
        shape = (s.B, s.T, s.H, DK)
        q = Stream(s.seed, self.key, "q").normalish(shape) * self.q_gain[:, None, :, None]
        jitter = 0.9 + 0.2 * Stream(s.seed, self.key, "hard", "q").uniform((s.B, s.T, s.H, HARD_CHANNELS))
        q[..., self.cols] = self.sign * self.q_amp[:, None, :, None] * jitter
        return _cast(q, dt)

    def kv(self, b: int, dt) -> np.ndarray:
        """[P_b + T, 576] cache rows of request b in dtype dt (tokens in order)."""
        s = self.spec
        P, n = s.prefix_lens[b], s.prefix_lens[b] + s.T
        x = Stream(s.seed, self.key, "kv", b).normalish((n, DK))
        x[:, :DV] += self.offset[b]
        st = Stream(s.seed, self.key, "hard", "kv", b)
        w = HARD_SPREAD * (2.0 * st.uniform((n, HARD_CHANNELS)) - 1.0)  # [n, C]
        if P > 0:
            pick = 1 + st.permutation(P - 1)  # prefix keys other than key 0, in random order
            w[0] = 1.0
            w[pick[: HARD_SINKS - 1]] = 1.0
            w[pick[HARD_SINKS - 1 : HARD_SINKS - 1 + HARD_ANTI]] = -1.0
        w[P:] = HARD_TAIL + (1.0 - HARD_TAIL) * (0.5 + w[P:] / (2.0 * HARD_SPREAD))  # uniform in [HARD_TAIL, 1]
        w[P] = 1.0  # the root's own key: seen by every node of the tree
        x[:, self.cols] = self.sign * HARD_K * w
        return _cast(x, dt)


def _cast(x: np.ndarray, dt) -> np.ndarray:
    """float64 -> dt with IEEE round-to-nearest-even (bf16 via fp32, as Stream.normalish does)."""
    if np.dtype(dt).itemsize < 4:
        x = x.astype(np.float32)
    return x.astype(dt)


def draft_logp(tlist: list[trees.Tree]) -> np.ndarray | None:
    """[B, L, K] drafter log-probs of DDTree trees (None for other families or budget 0)."""
    logps = [t.draft_logp for t in tlist]
    if any(x is None or x.size == 0 for x in logps):
        return None
    return np.stack(logps).astype(np.float64)
