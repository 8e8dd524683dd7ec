"""Planted bugs: the mistakes a verify kernel really makes, used to prove kdtr catches them.

Each bug exists as a variant of the CPU ``emulate-flash`` kernel (CI) and of the CUDA kernels: a
compile-time switch (template parameter ``BUG``, values from ``cuda/kdtr_abi.h``'s ``KdtrBug``; a test
keeps the two lists equal), or, for the bugs in LAUNCH_BUGS, a variant of the launch. Every bug but
those in GRAPH_ONLY fails a plain ``kdtr verify``; those fail ``kdtr verify --graph`` alone.
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
LAUNCH_BUGS = (Bug.BAKED_LENGTHS,)
"""Bugs planted in the launch, not in the kernel: the CUDA kernels run their correct build (BUG 0) under it."""


def kernel_bug(bug: Bug) -> int:
    """The BUG template value a CUDA kernel is built with for planted bug ``bug`` (0 for a launch bug)."""
    return 0 if bug in LAUNCH_BUGS else int(bug)
