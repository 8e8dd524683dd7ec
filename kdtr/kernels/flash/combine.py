"""The split merge launch of the flash kernels: which merge kernel of cuda/flash_split.cuh, on which grid.

Pure arithmetic on the rows, the split count and the build's config array (testable without a GPU).
The main kernel's plan (kdtr/kernels/flash/plan.py) decides whether there is a merge launch at all;
this module picks it. Every choice below was measured on the H200 (docs/PERF.md ledger).
"""

from __future__ import annotations

from collections.abc import Callable

from kdtr.inputs.presets import DV

COMBINE = "kdtr_flash_combine<{out}>"
COMBINE_ROWS = "kdtr_flash_combine_rows<{out}, {parts}>"
COMBINE_JOBS = "kdtr_flash_combine_jobs<{out}, {rows}>"
COMBINE_NARROW = "kdtr_flash_combine_narrow<{out}, {cols}, {warps}>"
"""Name templates of the split merges (cuda/flash_split.cuh): per row and column chunk, a warp per row
or half row (ROWS_PARTS), the work table's cut jobs, per row and 32- or 64-column chunk (NARROW_COLS) with 4
or 8 warps (NARROW_WARPS)."""
ROWS_PARTS = (1, 2)
"""The warp-per-row merge's parts of a row (its PARTS template argument): a warp merges a whole row, or half
of it with twice the splits in flight (rows_parts)."""
NARROW_COLS = (32, 64)
"""The narrow merge's chunk widths (its COLS template argument), narrowest first. Kimi decode, H200:
32 columns on one 8-row request (128 CTAs, 288 splits one L2 round trip; 64 was 0.6 us slower there);
64 on 16-80 rows (T1 B2, T5 B1, T9 B1: 0.1-1.6 us faster than 32 columns or kdtr_flash_combine's
128-column chunks; T5 B2 and T1 B4 level within ~1 %; 32 columns up to 4 us slower)."""
NARROW_WARPS = (4, 8)
"""The narrow merge's warps a CTA (its WARPS template argument), fewest first: the fewest that take every
split in one step of loads (narrow_warps). The merge is taken only where its grid is one wave of the chosen
build (combine_launch): at 8 warps and 80 registers 3 CTAs fit an SM, and Kimi T1 P32k B8's 512 CTAs (64 rows,
two waves) took 86.7-87.1 us against 84.5 with the 128-column merge."""
COMBINES = ("rows", "split", "narrow", *(f"narrow{c}" for c in NARROW_COLS))
"""The merge kernels a Force may name (kdtr/kernels/flash/force.py): "rows" COMBINE_ROWS, "split" COMBINE,
"narrow" COMBINE_NARROW at its planned width, "narrow32" / "narrow64" at that width."""


def combine_chunks(rows_total: int, sm_count: int, max_chunks: int) -> int:
    """Column chunks (combine CTAs) per output row: max_chunks while the rows alone would not cover
    the GPU twice (decode: 8-72 rows per request), else 1 (measured on the H200)."""
    return max_chunks if rows_total < 2 * sm_count else 1


def combine_launch(R: int, B: int, splits: int, sm_count: int, cfg: dict, per_sm: Callable[[str, int], int],
                   force: str | None = None) -> tuple[str, tuple, int]:
    """(name template, grid, threads) of the split merge launch. A warp per row (``COMBINE_ROWS``) where
    the rows alone cover the GPU twice and every split's lse fits a lane: the row-per-CTA merge
    is latency-bound there; ``COMBINE_NARROW`` (32- or 64-column chunks, narrow_cols; 4 or 8 warps,
    narrow_warps) on the few rows of decode launches where its grid is one wave (``per_sm(name, threads)``:
    CTAs of that build an SM, from its registers), where ``COMBINE``'s CTAs, one per row and 128 columns,
    read hundreds of splits in steps of one L2 round trip; else ``COMBINE`` with column chunks. ``force``:
    one of COMBINES ("rows" still needs the splits to fit a warp's lanes; "narrow" needs no single wave)."""
    force = force or ""
    threads = cfg["COMBINE_THREADS"]
    chunks = combine_chunks(R * B, sm_count, cfg["COMBINE_MAX_CHUNKS"])
    fits = splits <= cfg["COMBINE_ROWS_MAX_SPLITS"]
    narrow = force.startswith("narrow")  # "narrow" (the planned width), "narrow32", "narrow64"
    if fits and (force == "rows" or (force != "split" and not narrow and chunks == 1)):
        parts = rows_parts(splits, cfg["COMBINE_ROWS_BATCH"])
        return COMBINE_ROWS.format(out="{out}", parts=parts), (-(-R // (threads // 32)), B, parts), threads
    if narrow or (not force and chunks > 1):  # few rows: the narrow merge where one wave of it takes them
        cols = int(force[len("narrow"):] or narrow_cols(R * B, sm_count))
        warps = narrow_warps(splits, cols, cfg["NARROW_BATCH"])
        name, grid = COMBINE_NARROW.format(out="{out}", cols=cols, warps=warps), (R, B, DV // cols)
        if narrow or R * B * (DV // cols) <= per_sm(name, 32 * warps) * sm_count:
            return name, grid, 32 * warps
    return COMBINE, (R, B, chunks), threads


def rows_parts(splits: int, batch: int) -> int:
    """The warp-per-row merge's parts of a row: whole rows while one step of ``batch`` partial rows in flight
    takes every split, else halves (a warp then keeps 2 ``batch`` halves in flight in the same registers)."""
    return ROWS_PARTS[0] if splits <= batch else ROWS_PARTS[-1]


def narrow_cols(rows: int, sm_count: int) -> int:
    """The narrow merge's chunk width for ``rows`` output rows: the narrowest whose grid (a CTA per row
    and chunk) fits one CTA an SM, else the widest (NARROW_COLS)."""
    return next((c for c in NARROW_COLS if rows * (DV // c) <= sm_count), NARROW_COLS[-1])


def narrow_warps(splits: int, cols: int, batch: int) -> int:
    """The narrow merge's warps a CTA: the fewest (NARROW_WARPS) whose threads load every split in one step
    (``cols`` / 4 lanes share a partial row, each lane ``batch`` loads in flight), else the most."""
    return next((w for w in NARROW_WARPS if splits <= w * 32 // (cols // 4) * batch), NARROW_WARPS[-1])
