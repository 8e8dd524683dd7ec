"""Planted bugs: the mistakes a verify kernel really makes, used to prove kdtr catches them.

Each bug exists as a variant of the CPU ``emulate-flash`` kernel (CI) and of the CUDA kernels: a
compile-time switch (template parameter ``BUG``, values from ``cuda/kdtr_abi.h``'s ``KdtrBug``; a test
keeps the two lists equal), or, for the bugs in LAUNCH_BUGS, a variant of the launch. Every bug but
those in GRAPH_ONLY fails a plain ``kdtr verify`` on a problem that has what SHOWS_ON says it needs; those
fail ``kdtr verify --graph`` alone. The families are those kernel engineers get wrong: the tree mask (1,
9-13), indexing (2, 3, 7, 14-16), numerics (4, 6, 17-20), layout (5, 21) and graph capture (8).
Definitions, shared by every implementation:
"""

from __future__ import annotations

import enum

TILE = 64
"""KV tile width that "the last partial tile" refers to."""


class Bug(enum.IntEnum):
    NONE = 0
    SIBLING_VISIBLE = 1
    """Row t also sees tail node t-1 when that node is not its ancestor (a mask off-by-one)."""
    DROP_PREFIX_KEY = 2
    """The last prefix key (j = P_b - 1) is skipped when P_b > 0."""
    DROP_PARTIAL_TILE = 3
    """Prefix keys j >= TILE * (P_b // TILE) are skipped (the ragged last prefix tile)."""
    SCALE_OFF = 4
    """scale * 1.01 is used."""
    NO_ROPE = 5
    """Only the 512 latent columns enter q.k; the 64 RoPE columns are ignored."""
    MERGE_WRONG_MAX = 6
    """Partial results are merged without rescaling to the common max (each split's own max is
    taken as if it were global). Kernels with one split plant it as a 2-way split of the keys."""
    PAGE_OFF_BY_ONE = 7
    """Token j is read from page block_table[b, (j + 1) // page_size] (offset j % page_size)."""
    BAKED_LENGTHS = 8
    """The launch copies the prefix lengths it is prepared with into a buffer of its own and the kernel
    reads them there (its split counts, key ranges and tail position planned from the host's lengths):
    right wherever it is prepared and run on the same lengths, wrong where a CUDA graph captured at a
    server's dummy lengths is replayed at the real ones."""
    MASK_STRIDE = 9
    """Word w of node t's mask row is read at flat word (b * T + t) * (T // 32 + 1) + w of the mask (the row
    stride of a T + 1-node mask), its last word past the end: the same unless T is a multiple of 32."""
    MASK_BIT_ORDER = 10
    """Tree node c is read from bit 31 - c % 32 of its word (most significant bit first), not bit c % 32."""
    CAUSAL_MASK = 11
    """Node t sees tree nodes 0..t (a causal mask, right for a chain only), whatever its mask says."""
    MASK_REQUEST0 = 12
    """Every request reads request 0's tree mask."""
    NO_SELF = 13
    """Node t does not see itself, only its proper ancestors (an exclusive ancestor mask)."""
    Q_HEAD_MAJOR = 14
    """Query row (t, h) is read from q as if it were [B, H, T, 576] (row h * T + t of the request): the same
    where H = 1 or T = 1."""
    BLOCK_TABLE_STRIDE = 15
    """Request b's block-table row is read from entry b * ceil((P_b + T) / page_size), as if the rows were
    packed at each request's own page count, not b * max_pages: the same for b = 0."""
    TAIL_POSITION = 16
    """Tree node c's key and value are read at token c, not P_b + c: the same where P_b = 0."""
    NO_RUNNING_MAX = 17
    """The softmax subtracts no maximum: p = exp(s), l = sum p, lse = log l. Exact in exact arithmetic; in
    fp32 it overflows (inf, then NaN) where a visible score passes ~88."""
    LSE_LOG2 = 18
    """lse is written in base 2, log2 of the sum: the final lse where one split covers a row, each split's
    partial lse where splits are merged (the merge then weights the partials by exp of those values)."""
    OUT_TRUNCATE = 19
    """bf16 out: every value the kernel stores is rounded toward zero to bf16 (the float's top 16 bits), not
    to nearest even: out where one split covers a row, each split's fp32 partial row where splits are merged
    (the merge then rounds to nearest). fp32 out: the same."""
    MISSING_LOG2E = 20
    """The exp2-domain softmax misses its log2(e) factor: p = 2^(scale s - m) and lse = ln 2 (m + log2 l),
    which is the operator at scale * ln 2."""
    V_COLUMNS = 21
    """V is read from cache columns 64..575 (a RoPE-first row layout), not 0..511."""

    @property
    def slug(self) -> str:
        return self.name.lower().replace("_", "-")

    @classmethod
    def parse(cls, text: str) -> "Bug":
        for b in cls:
            if text in (b.slug, b.name, str(int(b))):
                return b
        raise ValueError(f"unknown bug {text!r}; known: {', '.join(b.slug for b in cls)}")


PLANTED = tuple(b for b in Bug if b is not Bug.NONE)
"""Every planted bug."""
GRAPH_ONLY = (Bug.BAKED_LENGTHS,)
"""Bugs a plain verify cannot see (prepared and run on the same lengths, they are right); verify --graph
fails them."""
PLAIN = tuple(b for b in PLANTED if b not in GRAPH_ONLY)
"""Bugs a plain verify fails."""
SHOWS_ON = {
    Bug.SIBLING_VISIBLE: "a tree whose node t - 1 is not always t's parent (not a chain)",
    Bug.MASK_STRIDE: "T a multiple of 32",
    Bug.MASK_REQUEST0: "requests with different trees",
    Bug.Q_HEAD_MAJOR: "H > 1 and T > 1",
    Bug.BLOCK_TABLE_STRIDE: "a request b > 0 with fewer pages than max_pages",
    Bug.TAIL_POSITION: "P_b > 0",
    Bug.NO_RUNNING_MAX: "a visible score past ~88 (outlier channels, sink keys)",
    Bug.OUT_TRUNCATE: "bf16 out and a check of the rounding's bias (truncation errs by under one bf16 ulp)",
    Bug.CAUSAL_MASK: "a tree that is not a chain",
}
"""What a problem needs for a planted bug to change its result (the others change any problem), so that a
test whose problem lacks it can say why it cannot see the bug."""
LAUNCH_BUGS = (Bug.BAKED_LENGTHS,)
"""Bugs planted in the launch, not in the kernel: the CUDA kernels run their correct build (BUG 0) under it."""


def kernel_bug(bug: Bug) -> int:
    """The BUG template value a CUDA kernel is built with for planted bug ``bug`` (0 for a launch bug)."""
    return 0 if bug in LAUNCH_BUGS else int(bug)
