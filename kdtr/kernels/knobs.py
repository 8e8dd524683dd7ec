"""The flash kernels' experiment knobs: environment variables that force one side of a planning
choice (docs/PERF.md measures each), parsed and checked in one place.

``kdtr verify`` and ``kdtr bench`` parse them before anything runs, so a misspelt value is one line
and exit code 2 rather than an error in every case; kdtr/kernels/flash/kernel.py and kdtr/kernels/launch.py read the same
parse when they plan a launch. Pure Python: tests/test_knobs.py covers it without a GPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from kdtr.kernels.flash.tma import L2_PROMOTIONS

TMA_PROMOTIONS = ("", *L2_PROMOTIONS)
"""KDTR_TMA_PROMOTION's values: "" (the default) or a name of kdtr/kernels/flash/tma.py's L2_PROMOTIONS."""
COMBINE_FORCES = ("", "rows", "split", "narrow", "narrow32", "narrow64")
"""KDTR_FLASH_COMBINE's values. The narrow widths are kdtr/kernels/flash/plan.py's NARROW_COLS, which imports this
module and so cannot be imported here: tests/test_knobs.py checks that the two lists agree."""


def merge_knob(value: str) -> int:
    """KDTR_FLASH_MERGE: "" the default (one merge unit per merging split), 0 the combine launch, N
    up to N units per merging split (experiments: docs/PERF.md, sessions 4 and 9)."""
    if value == "":
        return 1
    if not value.isdigit():
        raise ValueError(f"KDTR_FLASH_MERGE={value!r}: 0 (the combine launch) or N >= 1 (units per merging split)")
    return int(value)


def segments_knob(value: str) -> str:
    """KDTR_FLASH_SEGMENTS: "" the model's choice, "0" never, "1" the best cut wherever allowed, N >= 2
    a stream-K cut every N tiles."""
    if value not in ("", "0", "1") and not (value.isdigit() and int(value) >= 2):
        raise ValueError(f"KDTR_FLASH_SEGMENTS={value!r}: use 0 (never), 1 (wherever allowed) or N >= 2 (cut every N tiles)")
    return value


def pdl_knob(value: str) -> bool:
    """KDTR_PDL: "" or "1" dependent launches where they apply (kdtr/kernels/pdl.py), "0" never (A/B timing)."""
    if value not in ("", "0", "1"):
        raise ValueError(f"KDTR_PDL={value!r}: 1 (dependent launches, the default) or 0 (never)")
    return value != "0"


def _choice(name: str, value: str, allowed: tuple[str, ...], meaning: str) -> str:
    if value not in allowed:
        raise ValueError(f"{name}={value!r}: {meaning}")
    return value


def _count(name: str, value: str, meaning: str) -> int:
    if value != "" and not value.isdigit():
        raise ValueError(f"{name}={value!r}: {meaning}")
    return int(value or 0)


@dataclass(frozen=True)
class FlashKnobs:
    """The knobs' parsed values; the defaults are the plan's own choices."""

    mt: int = 0
    """KDTR_FLASH_MT: row tile of ``flash`` in m-tiles of 16 rows (1, 2 or 4); 0 the plan's."""
    splits: int = 0
    """KDTR_FLASH_SPLITS: the KV split count; 0 the plan's."""
    merge_units: int = 1
    """KDTR_FLASH_MERGE: flash-sm90's in-kernel merge takes up to this many units per split; 0 never."""
    combine: str = ""
    """KDTR_FLASH_COMBINE: "rows", "split" or "narrow" forces that merge kernel ("narrow32" / "narrow64" also
    its chunk width); "" the plan's."""
    xr: str = ""
    """KDTR_FLASH_XR: "0" transposed rows never, "1" wherever they apply (requests of <= 8 rows: all of them,
    XR_ONLY), "" where the model says."""
    tail: str = ""
    """KDTR_FLASH_TAIL: "1" the rows past 64 k as a second, XR_ONLY launch wherever they fit it (an
    experiment: slower where measured, docs/PERF.md session 13); "" or "0" never."""
    segments: str = ""
    """KDTR_FLASH_SEGMENTS: see segments_knob."""
    pdl: bool = True
    """KDTR_PDL: the split merge launched dependent on the main kernel (sm_90+)."""
    tma_promotion: str = ""
    """KDTR_TMA_PROMOTION: "none", "64", "128" or "256", the L2 promotion of flash-sm90's cache tensor map; "" the
    default (kdtr/kernels/flash/tma.py)."""

    @classmethod
    def from_env(cls, env=None) -> FlashKnobs:
        """Parse ``env`` (default os.environ); ValueError names the variable and its accepted values."""
        env = os.environ if env is None else env
        get = lambda name: env.get(name, "")  # noqa: E731
        return cls(
            mt=int(_choice("KDTR_FLASH_MT", get("KDTR_FLASH_MT"), ("", "0", "1", "2", "4"), "1, 2 or 4 (m-tiles of 16 rows)") or 0),
            splits=_count("KDTR_FLASH_SPLITS", get("KDTR_FLASH_SPLITS"), "N >= 1 splits (0: the plan's)"),
            merge_units=merge_knob(get("KDTR_FLASH_MERGE")),
            combine=_choice("KDTR_FLASH_COMBINE", get("KDTR_FLASH_COMBINE"),
                            COMBINE_FORCES,
                            "rows, split, narrow (its planned width), narrow32 or narrow64"),
            xr=_choice("KDTR_FLASH_XR", get("KDTR_FLASH_XR"), ("", "0", "1"), "0 (never) or 1 (wherever they apply)"),
            tail=_choice("KDTR_FLASH_TAIL", get("KDTR_FLASH_TAIL"), ("", "0", "1"), "0 (never) or 1 (wherever it applies)"),
            segments=segments_knob(get("KDTR_FLASH_SEGMENTS")),
            pdl=pdl_knob(get("KDTR_PDL")),
            tma_promotion=_choice("KDTR_TMA_PROMOTION", get("KDTR_TMA_PROMOTION"), TMA_PROMOTIONS,
                                  f"{', '.join(L2_PROMOTIONS)} (bytes an L2 miss of a TMA box fetches)"),
        )
