"""Forcing a flash plan: the Force record and the kernel-spec suffix that carries it.

Why a suffix: tests, tools and maintainers need each branch of the plan (kdtr/kernels/flash/plan.py) on
shapes whose model would not take it. Written into the kernel spec, ``flash-sm90[xr=1,splits=4]`` (also
``flash[mt=2]``, ``flash-sm90-bug=SLUG[xr=1]``, or ``flash[occupancy=sm_120]``: another arch's residency), the
choice is part of the kernel's name, so it survives isolation (a child process resolves the kernel again from
``kernel.name``) and shows in every report (a bench row of its own beside ``flash``); no environment variable
steers a kernel. Pure Python, no GPU.

Also here: the main kernels' template arguments as enums (cuda/flash_sm90.cu mirrors them; a test keeps
the values equal).
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, fields

from kdtr.errors import KernelSpecError
from kdtr.kernels.flash.arch import EMULATED_ARCHS
from kdtr.kernels.flash.combine import COMBINES


class Merge(enum.IntEnum):
    """How a launch merges its splits: flash-sm90's {merge} template (cuda/flash_sm90.cu, enum Merge)."""

    COMBINE = 0
    """One split, or a combine launch after the main kernel (kdtr/kernels/flash/combine.py)."""
    IN_KERNEL = 1
    """The last splits of each row tile merge them inside the main kernel (one-wave grids)."""
    WORK_TABLE = 2
    """The grid is a work table of pieces (kdtr/kernels/flash/schedule.py); cut jobs merged by a launch after."""


class RowLayout(enum.IntEnum):
    """Where flash-sm90 puts a request's rows: its {xr} template (cuda/flash_sm90.cu, enum RowLayout)."""

    TILES = 0
    """64-row tiles only."""
    TRANSPOSED = 1
    """A request of 1..EXTRA rows (Kimi decode): every row transposed, no 64-row products, two CTAs an SM."""
    EXTRA = 8
    """The last row tile also takes the 1..8 rows past a multiple of 64 as transposed rows (Kimi T9: 72 rows)."""


MERGE_VALUES = {"combine": Merge.COMBINE, "kernel": Merge.IN_KERNEL}
"""The suffix's merge=VALUE words."""


@dataclass(frozen=True)
class Force:
    """A forced flash plan: each field set overrides one choice of the plan; None leaves it to the plan.
    Fields apply where the shape allows them (a forced transposed-rows layout needs rows past 64, say)."""

    mt: int | None = None
    """Row tile in m-tiles of 16 rows: one of the kernel's (flash 1, 2 or 4; flash-sm90 4)."""
    splits: int | None = None
    """KV splits per request (>= 1); the planted merge bug still gets at least 2."""
    merge: Merge | None = None
    """Merge.COMBINE: a combine launch even where the kernel could merge its splits itself. Merge.IN_KERNEL:
    the in-kernel merge wherever it can run (a one-wave grid, one (row, 128-column) unit a split), so
    neither transposed rows nor a work table, which never merge there (flash-sm90 only)."""
    combine: str | None = None
    """The combine launch's kernel: one of kdtr/kernels/flash/combine.py's COMBINES."""
    xr: bool | None = None
    """Transposed rows (flash-sm90): False never; True wherever they apply (all rows of a request of <= 8)."""
    segments: int | None = None
    """The work table (flash-sm90): 0 never, 1 the model's best cut wherever allowed (even without a gain),
    N >= 2 a stream-K cut every N tiles."""
    occupancy: str | None = None
    """Time the portable kernel (flash) under another arch's residency: an arch of kdtr/kernels/flash/arch.py's
    EMULATED_ARCHS (sm_120). The plan counts that arch's CTAs an SM, and every launch asks for enough more dynamic shared memory
    that this GPU holds exactly as many of its CTAs an SM as that arch would (plan.emulated_smem)."""

    def suffix(self) -> str:
        """The kernel-spec suffix that parses back to this record ("" for no force), keys in field order."""
        words = []
        for f in fields(self):
            v = getattr(self, f.name)
            if v is None:
                continue
            if f.name == "merge":
                v = next(k for k, m in MERGE_VALUES.items() if m is v)
            elif f.name == "xr":
                v = int(v)
            words.append(f"{f.name}={v}")
        return f"[{','.join(words)}]" if words else ""


KEYS = tuple(f.name for f in fields(Force))
SUFFIX = re.compile(r"(?P<head>[^\[\]]+)\[(?P<body>[^\[\]]*)\]")
"""A spec with a force suffix: head[KEY=VALUE,...]."""


def split_suffix(spec: str) -> tuple[str, str | None]:
    """(head, suffix body) of ``spec``; body None when the spec has no [...] suffix."""
    m = SUFFIX.fullmatch(spec)
    return (m["head"].strip(), m["body"]) if m else (spec, None)


def parse_force(spec: str, body: str, variant) -> Force:
    """The Force of suffix ``body`` (the text between the brackets of ``spec``) for a kernel of
    ``variant`` (kdtr/kernels/flash/kernel.py's FlashVariant: which keys and values it takes).
    KernelSpecError, one line naming the key and what it takes, for anything else."""
    def bad(why: str) -> KernelSpecError:
        return KernelSpecError(f"{spec}: {why}")

    name = variant.label
    if not body.strip():
        raise bad(f"an empty plan suffix; give KEY=VALUE pairs, e.g. {name}[splits=4]")
    values: dict = {}
    for word in (w.strip() for w in body.split(",")):
        key, eq, text = (x.strip() for x in word.partition("="))
        if not eq or not key or not text:
            raise bad(f"{word!r} is not KEY=VALUE; keys: {', '.join(KEYS)}")
        if key not in KEYS:
            raise bad(f"unknown key {key!r}; keys: {', '.join(KEYS)}")
        if key in values:
            raise bad(f"{key} given twice")
        values[key] = _value(key, text, variant, bad)
    force = Force(**values)
    if force.merge is Merge.IN_KERNEL and force.xr:
        raise bad("merge=kernel with xr=1: transposed rows never merge in the kernel")
    if force.merge is Merge.IN_KERNEL and force.segments:
        raise bad("merge=kernel with segments: a work table never merges in the kernel")
    if force.xr and force.segments:
        raise bad("xr=1 with segments: transposed rows never take a work table")
    return force


def _value(key: str, text: str, variant, bad):
    """One key's value, checked against what ``variant`` can do."""
    name = variant.label
    if key == "mt":
        if not text.isdigit() or int(text) not in variant.mts:
            mts = ", ".join(map(str, variant.mts[:-1])) + (" or " if len(variant.mts) > 1 else "") + str(variant.mts[-1])
            raise bad(f"mt={text}: {name} takes mt={mts} (its row tiles, in m-tiles of 16 rows)")
        return int(text)
    if key == "splits":
        if not text.isdigit() or int(text) < 1:
            raise bad(f"splits={text}: give N >= 1 KV splits per request")
        return int(text)
    if key == "merge":
        if text not in MERGE_VALUES:
            raise bad(f"merge={text}: give merge=combine (a combine launch) or merge=kernel (in the kernel)")
        if MERGE_VALUES[text] is Merge.IN_KERNEL and not variant.merges_in_kernel:
            raise bad(f"merge=kernel: {name} merges its splits by a combine launch only")
        return MERGE_VALUES[text]
    if key == "combine":
        if text not in COMBINES:
            raise bad(f"combine={text}: give one of {', '.join(COMBINES)}")
        return text
    if key == "xr":
        if text not in ("0", "1"):
            raise bad(f"xr={text}: give xr=0 (no transposed rows) or xr=1 (wherever they apply)")
        if not variant.extra_rows:
            raise bad(f"xr={text}: {name} has no transposed rows (flash-sm90 has)")
        return text == "1"
    if key == "occupancy":
        if text not in EMULATED_ARCHS:
            raise bad(f"occupancy={text}: give occupancy={' or '.join(EMULATED_ARCHS)} (that arch's CTAs an SM, "
                      f"emulated on this GPU)")
        if variant.arch:
            raise bad(f"occupancy={text}: {name} runs on {variant.arch} alone, where no other arch's residency "
                      f"applies; the portable flash takes occupancy=")
        return text
    if not text.isdigit():
        raise bad(f"segments={text}: give 0 (never), 1 (wherever allowed) or N >= 2 (a cut every N tiles)")
    if not variant.tile_ns:
        raise bad(f"segments={text}: {name} takes no work table (flash-sm90 does)")
    return int(text)
