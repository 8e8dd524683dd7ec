"""Planted bugs: the mistakes a verify kernel really makes, used to prove kdtr catches them.

Each bug exists as a variant of the CPU ``emulate-flash`` kernel (CI) and as a compile-time
switch of the CUDA kernels (template parameter ``BUG``, values from ``cuda/kdtr_abi.h``'s
``KdtrBug``; a test keeps the two lists equal). Definitions, shared by every implementation:
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
