"""The flash kernels' launch plan: pure arithmetic on the shape and the SM count, testable without a GPU.

The row tile (16, 32 or 64 rows), the KV split count from a small cost model (waves of CTAs times
the keys each CTA walks, plus the combine's traffic), whether flash-sm90 merges the splits itself
(one-wave decode grids) or a combine launch does (and which), where its transposed rows pay, and
the segments' work table. kdtr/kernels/flash/kernel.py turns a plan into launches; every model constant below was
measured on the H200 (docs/PERF.md names the run).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kdtr.kernels.bugs import Bug
from kdtr.kernels.knobs import segments_knob
from kdtr.inputs.presets import DK, DV

COMBINE = "kdtr_flash_combine<{out}>"
COMBINE_ROWS = "kdtr_flash_combine_rows<{out}, {parts}>"
COMBINE_JOBS = "kdtr_flash_combine_jobs<{out}, {rows}>"
COMBINE_NARROW = "kdtr_flash_combine_narrow<{out}, {cols}, {warps}>"
"""Name templates of the split merges (cuda/flash_split.cuh): per row and column chunk, a warp per row
or half row (ROWS_PARTS), the segments' cut jobs, per row and 32- or 64-column chunk (NARROW_COLS) with 4
or 8 warps (NARROW_WARPS)."""
ROWS_PARTS = (1, 2)
"""The warp-per-row merge's parts of a row (its PARTS template argument): a warp merges a whole row, or half
of it with twice the splits in flight (rows_parts; docs/PERF.md, session 17)."""
NARROW_COLS = (32, 64)
"""The narrow merge's chunk widths (its COLS template argument), narrowest first. Kimi decode, H200
(docs/PERF.md, sessions 15-16): 32 columns on one 8-row request (128 CTAs, 288 splits one L2 round trip;
64 was 0.6 us slower there); 64 on 16-80 rows (T1 B2, T5 B1, T9 B1: 0.1-1.6 us faster than 32 columns or
kdtr_flash_combine's 128-column chunks; T5 B2 and T1 B4 level within ~1 %; 32 columns up to 4 us slower)."""
NARROW_WARPS = (4, 8)
"""The narrow merge's warps a CTA (its WARPS template argument), fewest first: the fewest that take every
split in one step of loads (narrow_warps). The merge is taken only where its grid is one wave of the chosen
build (combine_launch): at 8 warps and 80 registers 3 CTAs fit an SM, and Kimi T1 P32k B8's 512 CTAs (64 rows,
two waves) took 86.7-87.1 us against 84.5 with the 128-column merge (docs/PERF.md, session 17)."""

NS_PER_KEY = 50.0
"""Model: one CTA's time per key of a full tile (~max of MMA time and KV bytes at one SM's share)."""
COMBINE_BYTES_PER_NS = 3000.0
"""Model: partial out written and read back at ~3 TB/s."""
LAUNCH_NS = 3000.0
"""Model: the extra combine launch."""
MIN_KEYS_PER_SPLIT = 64
XR_TILE_COST = 1.8
"""Model: a tile of a CTA with transposed rows against one of 64 rows (flash-sm90, H200, session 7:
3742 vs 2104 cycles per tile on Kimi T9 B32, 4500 vs 2365 on B1)."""
CTA_FIXED_TILES, XR_CTA_FIXED_TILES = 4.7, 8.6
"""Model: a CTA's prologue and epilogue in 64-row tiles, without and with transposed rows (same
runs: ~10 000 and ~18 000 cycles)."""
XR_ONLY = 1
"""The {xr} template of a request of 1..extra_rows rows (Kimi decode): every row transposed, no 64-row
products, so the build (cuda/flash_sm90.cu, XR_ONLY) is launched two CTAs to an SM. Taken where the
64-row plan needs several waves, or where KDTR_FLASH_XR=1 forces transposed rows (plan())."""
SEGMENT_ROWS = 64
"""Segments only for requests of 64+ rows: tile_ns and CTA_FIXED_TILES were measured on full 64-row
tiles of the compute shapes, not on decode CTAs whose tiles wait on HBM."""
MERGE_UNITS_PER_ROW = DV // 128
"""The in-kernel merge works in (row, 128-column group) units, one CTA's 8 warps sharing a unit's
splits (cuda/flash_split.cuh, merge_in_kernel); it is used only while no CTA gets two units."""


@dataclass(frozen=True)
class FlashPlan:
    """Launch geometry of one flash verify."""

    mt: int
    """m-tiles of 16 rows per CTA (1, 2 or 4)."""
    row_tiles: int
    """ceil(T * H / (16 * mt)) CTAs along x."""
    splits: int
    """KV splits per request (CTAs along y); > 1 adds the combine launch."""
    B: int
    """Requests (CTAs along z)."""
    merge: bool = False
    """The main kernel merges the splits (one-wave grid, kernel able to); else the combine launch does."""
    xr: int = 0
    """The {xr} template: the last row tile also takes the 1..xr rows past a multiple of 16 * mt (0: none;
    XR_ONLY: the one row tile's rows are all transposed)."""
    tail: bool = False
    """The 1..8 rows past the last multiple of 64 run as a second, XR_ONLY launch beside the row tiles'
    (grid (1, splits, B), launched dependent so that it starts at once on the SMs the first leaves free)."""

    @property
    def grid(self) -> tuple[int, int, int]:
        return (self.row_tiles, self.splits, self.B)

    def workspace_bytes(self, T: int, H: int) -> int:
        """fp32 partial out [B, S, R, 512] + partial lse [B, S, R] + uint32 merge counters [B, row tiles, 2],
        when splits > 1 (cuda/flash_split.cuh)."""
        return 0 if self.splits == 1 else self.B * self.splits * T * H * (512 + 1) * 4 + self.B * self.row_tiles * 8


def row_tile_m(rows: int) -> int:
    """m-tiles per CTA for a request of `rows` query rows (measured on the H200, docs/PERF.md:
    16 rows for decode; 32 up to 128 rows, where more CTAs per SM beat KV reuse; 64 beyond)."""
    return 1 if rows <= 16 else 2 if rows <= 128 else 4


def split_range(P: int, T: int, splits: int, bn: int, split: int) -> tuple[int, int]:
    """Prefix keys [lo, hi) of one split, cut as cuda/flash_split.cuh's split_keys cuts them: every
    split gets ceil((prefix tiles + tail tiles) / splits) tiles of bn keys and the last one also
    walks the tree tail, so it takes fewer prefix keys (tests/test_gpu_verify.py checks the two agree)."""
    length = max(1, -(-(-(-P // bn) + -(-T // bn)) // splits)) * bn
    lo = min(P, split * length)
    return lo, P if split == splits - 1 else min(P, lo + length)


def split_ranges(P: int, T: int, splits: int, bn: int) -> list[tuple[int, int]]:
    """split_range of every split, in order."""
    return [split_range(P, T, splits, bn, s) for s in range(splits)]


def tiles_per_split(P: int, T: int, splits: int, bn: int) -> int:
    """KV tiles the busiest split walks (the tail counted whole): a one-wave grid waits for it.
    The first split is the longest of the others, so only it and the last are cut."""
    lo, hi = split_range(P, T, splits, bn, splits - 1)
    last = -(-(hi - lo) // bn) + -(-T // bn)
    if splits == 1:
        return last
    a, b = split_range(P, T, splits, bn, 0)
    return max(last, -(-(b - a) // bn))


def plan_cost(prefix_max: int, T: int, bn: int, base_ctas: int, rows: int, B: int, slots: int, s: int,
              tile_cost: float = 1.0, fixed_tiles: float = 0.0) -> float:
    """Model, ns: waves * (keys per CTA * tile_cost + a CTA's fixed tiles) + the combine's traffic."""
    waves = math.ceil(base_ctas * s / slots)
    cost = waves * (tiles_per_split(prefix_max, T, s, bn) * tile_cost + fixed_tiles) * bn * NS_PER_KEY
    if s > 1:
        cost += B * rows * 4096 * s * 2 / COMBINE_BYTES_PER_NS + LAUNCH_NS
    return cost


def choose_splits(prefix_max: int, T: int, bn: int, base_ctas: int, rows: int, B: int, slots: int) -> int:
    """Split count minimising waves * keys-per-CTA + combine traffic; slots = resident CTAs on the GPU."""
    if prefix_max <= MIN_KEYS_PER_SPLIT:
        return 1
    best, best_cost = 1, math.inf
    for s in range(1, min(256, prefix_max // MIN_KEYS_PER_SPLIT) + 1):
        cost = plan_cost(prefix_max, T, bn, base_ctas, rows, B, slots, s)
        if cost < best_cost - 1e-9:
            best, best_cost = s, cost
    return best


def occupancy(threads: int, registers: int, smem: int, regs_per_sm: int = 65536, smem_per_sm: int = 233472) -> int:
    """Resident CTAs per SM allowed by registers (allocated per warp in 256s) and shared memory."""
    regs_per_warp = math.ceil(registers * 32 / 256) * 256
    by_regs = regs_per_sm // (regs_per_warp * math.ceil(threads / 32))
    by_smem = smem_per_sm // (smem + 1024)  # 1 KB per CTA reserved by the hardware
    return max(1, min(by_regs, by_smem, 32))


def combine_chunks(rows_total: int, sm_count: int, max_chunks: int) -> int:
    """Column chunks (combine CTAs) per output row: max_chunks while the rows alone would not cover
    the GPU twice (decode: 8-72 rows per request), else 1 (measured on the H200, docs/PERF.md)."""
    return max_chunks if rows_total < 2 * sm_count else 1


def combine_launch(R: int, B: int, splits: int, sm_count: int, cfg: dict, per_sm: Callable[[str, int], int],
                   force: str = "") -> tuple[str, tuple, int]:
    """(name template, grid, threads) of the split merge launch. A warp per row (``COMBINE_ROWS``) where
    the rows alone cover the GPU twice and every split's lse fits a lane: the row-per-CTA merge
    is latency-bound there (docs/PERF.md, session 6); ``COMBINE_NARROW`` (32- or 64-column chunks,
    narrow_cols; 4 or 8 warps, narrow_warps) on the few rows of decode launches where its grid is one wave
    (``per_sm(name, threads)``: CTAs of that build an SM, from its registers), where ``COMBINE``'s CTAs, one
    per row and 128 columns, read hundreds of splits in steps of one L2 round trip (docs/PERF.md, sessions
    15-17); else ``COMBINE`` with column chunks. ``force``: "rows", "split", "narrow" (its width as planned),
    "narrow32" or "narrow64" (experiments and tests; "rows" still needs splits to fit, "narrow" needs no wave)."""
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


def extra_row_tiles(rows: int, tile: int, extra_rows: int) -> tuple[int, int]:
    """(row tiles, xr): a remainder of 1..extra_rows rows past a multiple of ``tile`` can ride in the
    last tile as transposed products instead of a CTA of its own (Kimi T9: 72 rows, one CTA)."""
    tiles, rem = -(-rows // tile), rows % tile
    if extra_rows and rows > tile and 0 < rem <= extra_rows:
        return tiles - 1, extra_rows
    return tiles, 0


def merged_splits(splits: int, bug: int) -> int:
    """``splits``, at least 2 for the planted merge bug (it needs a merge to show)."""
    return max(2, splits) if bug == Bug.MERGE_WRONG_MAX else splits


def plan(B: int, T: int, H: int, prefix_max: int, sm_count: int, bn: int, bug: int = 0, mt: int | None = None,
         ctas_per_sm: int = 1, splits: int | None = None, can_merge: bool = False, extra_rows: int = 0,
         xr_always: bool = False, merge_units: int = 1, x_only_ctas_per_sm: int = 0, tail: str = "") -> FlashPlan:
    """Launch geometry for KV tiles of ``bn`` keys; ``mt`` / ``splits`` force the row tile / split
    count (experiments).

    ``can_merge``: the kernel can merge its splits itself. It does when every CTA is resident at
    once (a merging CTA waits for the other splits of its row tile, which must not be waiting for
    a slot) and each split merges ``merge_units`` units at most: a second unit in a row made Kimi T9
    decode slower than the combine launch (docs/PERF.md, session 4). ``extra_rows``: the kernel's XR_MAX
    (extra_row_tiles), taken where the cost model says it pays, or wherever it applies with ``xr_always``.
    ``x_only_ctas_per_sm``: the XR_ONLY build's residency (0: none). A request of at most ``extra_rows`` rows
    takes it: where the 64-row plan needs more than one wave, two CTAs per SM halve the waves (Kimi T1 P128k
    B32 2-7 % faster, session 13); on one-wave grids (Kimi T1 B1-B4) it streams faster and, since the
    combine launch merges few rows in 32-column chunks, ends 0.7-3.2 us sooner than the 64-row build with
    its in-kernel merge (docs/PERF.md, session 15; merging in-kernel, in 32-column units, it was no
    faster: branch wip/xonly-narrow-merge).
    ``tail``: "1" runs the 1..8 rows of 64 k + 1..8 as a tail launch (FlashPlan.tail): the 64-row tiles get
    the splits that the tail's half-SM CTAs leave room for (Kimi T9 B1: 88 instead of 66 on 132 SMs). Only
    where forced: it measured 1.3-9.1 us slower on Kimi T9 / T17 (docs/PERF.md, session 13)."""
    rows = T * H
    mt = mt or row_tile_m(rows)
    row_tiles, xr = extra_row_tiles(rows, 16 * mt, extra_rows)
    if x_only_ctas_per_sm and tail == "1" and xr:  # the row tiles' launch; each tail CTA takes 1 / x_only_ctas_per_sm SM
        s = splits or max(1, min(int(sm_count * ctas_per_sm / (B * (row_tiles + 1 / x_only_ctas_per_sm))),
                                 prefix_max // MIN_KEYS_PER_SPLIT))
        return FlashPlan(mt, row_tiles, merged_splits(s, bug), B, False, 0, True)
    if x_only_ctas_per_sm and 0 < rows <= extra_rows:
        s = plan(B, T, H, prefix_max, sm_count, bn, bug, mt, x_only_ctas_per_sm, splits).splits  # its 64-row plan's splits
        return FlashPlan(mt, 1, s, B, False, XR_ONLY)
    slots = sm_count * ctas_per_sm
    chosen = splits or choose_splits(prefix_max, T, bn, row_tiles * B, rows, B, slots)
    if xr and not xr_always:  # transposed rows only where the model says they pay (their tiles cost XR_TILE_COST)
        plain = -(-rows // (16 * mt))
        plain_splits = splits or choose_splits(prefix_max, T, bn, plain * B, rows, B, slots)
        if (plan_cost(prefix_max, T, bn, plain * B, rows, B, slots, plain_splits, 1.0, CTA_FIXED_TILES)
                <= plan_cost(prefix_max, T, bn, row_tiles * B, rows, B, slots, chosen, XR_TILE_COST, XR_CTA_FIXED_TILES)):
            row_tiles, xr, chosen = plain, 0, plain_splits
    splits = merged_splits(chosen, bug)
    units = min(rows, 16 * mt) * MERGE_UNITS_PER_ROW  # of the fullest row tile
    # rows past 64 (transposed) never merge in-kernel: they make 260+ units (XR_ONLY returned above: the combine)
    merge = can_merge and not xr and splits > 1 and units <= merge_units * splits and row_tiles * splits * B <= slots
    return FlashPlan(mt, row_tiles, splits, B, merge, xr)


def choose_segments(P, T: int, H: int, pl: FlashPlan, slots: int, bn: int, tile_ns: float, bug: int = 0,
                    force: str = "", l2_bytes: int = 0, forced_splits: bool = False):
    """The segments (kdtr/kernels/flash/schedule.py) that replace plan ``pl``, or None to keep it. Taken where the
    model says they save MIN_GAIN; never with the in-kernel merge, transposed rows or a tail launch (all
    find their row tile by the grid) or a forced split count. ``force``: "0" never, "1" the best cut even
    without a gain, N >= 2 a stream-K cut every N tiles (experiments and tests). P: [B] prefix
    lengths; l2_bytes: the device's L2, which drifting cuts need the KV they cut to fit in."""
    from kdtr.kernels.flash import schedule

    force = segments_knob(force)
    if force == "0" or not tile_ns or pl.merge or pl.xr or pl.tail or (not force and (T * H < SEGMENT_ROWS or forced_splits)):
        return None
    rows_per_tile = 16 * pl.mt
    model = {"fixed_tiles": CTA_FIXED_TILES, "ns_per_tile": tile_ns, "bytes_per_ns": COMBINE_BYTES_PER_NS,
             "launch_ns": LAUNCH_NS}
    jobs = schedule.jobs_of(P, T, pl.row_tiles, bn)
    interval = int(force) if force.isdigit() and int(force) >= 2 else 0
    kv_bytes = np.asarray(P, np.int64) * DK * 2
    uniform, found = schedule.best(jobs, T * H, rows_per_tile, slots, pl.splits, model, interval, kv_bytes, l2_bytes)
    if found is uniform or (bug == Bug.MERGE_WRONG_MAX and not found.split_jobs()):
        return None  # the planted merge bug needs a merge: the uniform plan gives it one
    return found if force or found.cost_ns < uniform.cost_ns * (1 - schedule.MIN_GAIN) else None
