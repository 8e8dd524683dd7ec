"""The flash kernels' launch plan: pure arithmetic on the shape and the SM count, testable without a GPU.

Graph-safe by construction: a plan is made once from the shapes and a capacity (B, T, H, the longest
prefix to serve, the SM count), never from the prefix lengths, because a server captures the launch in a
CUDA graph at dummy lengths and replays it at the real ones (docs/KERNELS.md, "Graph safety"). What
depends on the lengths is decided on the device at every launch: each request's KV split count by a
lookup in the plan's split table (SplitModel.table, the cost model below tabulated over every prefix
length up to the capacity), and, for flash-sm90's work table, the pieces themselves (the device
scheduler of cuda/flash_sched.cuh, following the recipe kdtr/kernels/flash/schedule.py chose here).

The plan decides: the row tile (by the cost model beyond 32 rows), the grid's split count (the most any
request takes), whether flash-sm90 merges the splits itself (one-wave decode grids) or a combine launch does
(kdtr/kernels/flash/combine.py picks which), where its transposed rows pay, and whether a work table replaces
the uniform splits. A Force (kdtr/kernels/flash/force.py) overrides any of these choices.
kdtr/kernels/flash/kernel.py turns a plan into launches; every model constant below was measured on the H200
(docs/PERF.md ledger) unless its docstring names the H100.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from kdtr.inputs.presets import DK, DV
from kdtr.kernels.bugs import Bug
from kdtr.kernels.flash.arch import RESERVED_SMEM, SM_90, SMEM_GRANULE, ArchLimits
from kdtr.kernels.flash.force import Force, Merge, RowLayout

NS_PER_KEY = 50.0
"""Model: one CTA's time per key of a full tile (~max of MMA time and KV bytes at one SM's share)."""
COMBINE_BYTES_PER_NS = 3000.0
"""Model: partial out written and read back at ~3 TB/s."""
LAUNCH_NS = 3000.0
"""Model: the extra combine launch."""
MIN_KEYS_PER_SPLIT = 64
XR_TILE_COST = 1.8
"""Model: a tile of a CTA with transposed rows against one of 64 rows (flash-sm90, H200: 3742 vs 2104
cycles per tile on Kimi T9 B32, 4500 vs 2365 on B1)."""
CTA_FIXED_TILES, XR_CTA_FIXED_TILES = 4.7, 8.6
"""Model: a CTA's prologue and epilogue in 64-row tiles, without and with transposed rows (same
runs: ~10 000 and ~18 000 cycles)."""
SCHEDULER_NS = 20_000.0
"""Model: what a work table's device scheduler adds before the main kernel (its launch, its run, the main kernel's
wait; cold launches of the three work-table shapes measured 20-26 us slower than with the host-built table)."""
MAX_TABLE_PIECES = 4096
"""Pieces the device scheduler sorts at most (cuda/flash_sched.cuh, SCHED_MAX_PIECES; a test keeps them equal)."""
MAX_TABLE_JOBS = 4096
"""(request, row tile) jobs the device scheduler takes at most (cuda/flash_sched.cuh, SCHED_MAX_JOBS)."""
WORK_TABLE_ROWS = 64
"""A work table only for requests of 64+ rows: tile_ns and CTA_FIXED_TILES were measured on full 64-row
tiles of the compute shapes, not on decode CTAs whose tiles wait on HBM."""
MERGE_UNITS_PER_ROW = DV // 128
"""The in-kernel merge works in (row, 128-column group) units, one CTA's 8 warps sharing a unit's
splits (cuda/flash_split.cuh, merge_in_kernel); it is used only while no split gets two units (a second
unit a split made Kimi T9 decode slower than the combine launch)."""


@dataclass(frozen=True)
class Shape:
    """What the plan needs of a verify launch: shapes and a capacity, never the prefix lengths."""

    B: int
    """Requests."""
    T: int
    """Tree nodes per request."""
    H: int
    """Query heads."""
    capacity: int
    """The longest prefix the launch must serve, keys (a server's context limit; for a problem, what its
    block table holds: capacity_of). Longer prefixes still run correctly, at the capacity's split count."""

    @property
    def rows(self) -> int:
        """Query rows per request (node * H + head)."""
        return self.T * self.H

    @classmethod
    def of(cls, problem) -> Shape:
        """The shape of a kdtr.inputs.problem.Problem: its capacity is what its buffers hold (capacity_of)."""
        return cls(problem.B, problem.T, problem.H, capacity_of(problem))


CAPACITY_GRAIN = 64
"""capacity_of rounds down to whole multiples of this many keys (the kernels' tiles divide it)."""


def capacity_of(problem) -> int:
    """The longest prefix a problem's buffers hold: its block table's pages less the tree, rounded down to
    whole CAPACITY_GRAIN keys (a block table sized for a prefix of whole 64-key tiles gives that prefix back).
    A shape, not a length: a CUDA graph captured on these buffers at dummy lengths plans the same launch as a
    direct run."""
    held = problem.block_table.shape[1] * problem.page_size - problem.T
    return max(0, held // CAPACITY_GRAIN * CAPACITY_GRAIN)


@dataclass(frozen=True)
class Device:
    """What the plan needs of the GPU."""

    sm_count: int
    """Streaming multiprocessors."""
    l2_bytes: int = 0
    """L2 cache: a work table's drifting cuts need the KV they cut to fit in it (0: never)."""


@dataclass(frozen=True)
class Build:
    """What the kernel's builds can do for this request: row tile, KV tile, residency, abilities."""

    mt: int
    """Row tile in m-tiles of 16 rows (the kernel's choice, choose_row_tile, or a Force's)."""
    bn: int
    """Keys per KV tile (the build's config array)."""
    ctas_per_sm: int = 1
    """Resident CTAs an SM of the main build (its registers and shared memory)."""
    bug: int = 0
    """The planted bug (kdtr/kernels/bugs.py): the merge bug needs a merge to show."""
    merges_in_kernel: bool = False
    """The main kernel can merge its splits itself (Merge.IN_KERNEL)."""
    extra_rows: int = 0
    """Rows past 16 * mt the last row tile can take as transposed rows (RowLayout.EXTRA); 0: none."""
    transposed_ctas_per_sm: int = 0
    """Resident CTAs an SM of the all-transposed build (RowLayout.TRANSPOSED); 0: none for this request."""
    tile_ns: float = 0.0
    """Measured time of one KV tile of a 64-row CTA, ns (the work table's model); 0: no work table."""


@dataclass(frozen=True)
class FlashPlan:
    """Launch geometry of one flash verify."""

    mt: int
    """m-tiles of 16 rows per CTA (1, 2 or 4)."""
    row_tiles: int
    """ceil(T * H / (16 * mt)) CTAs along x."""
    splits: int
    """KV splits per request (CTAs along y); > 1 adds the combine launch unless the kernel merges."""
    B: int
    """Requests (CTAs along z)."""
    merge: Merge = Merge.COMBINE
    """Merge.IN_KERNEL: the main kernel merges the splits (one-wave grid, kernel able to); else the combine
    launch does (Merge.WORK_TABLE is choose_work_table's, never a plan's)."""
    xr: RowLayout = RowLayout.TILES
    """The {xr} template: EXTRA, the last row tile also takes the 1..8 rows past a multiple of 16 * mt;
    TRANSPOSED, the one row tile's rows are all transposed."""
    model: SplitModel | None = None
    """Each request's split count on the device (its table); None only for plans made by hand in tests."""

    @property
    def grid(self) -> tuple[int, int, int]:
        return (self.row_tiles, self.splits, self.B)

    def workspace_bytes(self, T: int, H: int) -> int:
        """fp32 partial out [B, S, R, 512] + partial lse [B, S, R] + uint32 merge counters [B, row tiles, 2],
        when splits > 1 (cuda/flash_split.cuh)."""
        return 0 if self.splits == 1 else self.B * self.splits * T * H * (512 + 1) * 4 + self.B * self.row_tiles * 8


def row_tile_choices(rows: int) -> tuple[int, ...]:
    """Row tiles (m-tiles a CTA) the plan weighs for a request of ``rows`` query rows: 16 rows for decode, 32 up to
    32 rows; beyond, 32 or 64 by the cost model (choose_row_tile). A request of 33-64 rows (Kimi T5: 40) fills
    one 64-row tile that reads its KV once, where two 32-row tiles would each read it (`mt4-short`)."""
    return (1,) if rows <= 16 else (2,) if rows <= 32 else (2, 4)


def split_range(P: int, T: int, splits: int, bn: int, split: int) -> tuple[int, int]:
    """Prefix keys [lo, hi) of one split, cut as cuda/flash_split.cuh's split_keys cuts them: every
    split gets ceil((prefix tiles + tail tiles) / splits) tiles of bn keys and the last one also
    walks the tree tail, so it takes fewer prefix keys (tests/check/test_gpu_verify.py checks the two agree)."""
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


SPLIT_MAX = 256
"""Splits of one request at most."""
COST_UNIT = 3000
"""split_counts prices in ns x COST_UNIT, exact integers: the combine's bytes over COMBINE_BYTES_PER_NS
(3000 bytes a ns) become whole numbers, so the host's table and every tie are exact."""


def split_counts(tiles, T: int, bn: int, base_ctas: int, rows: int, B: int, slots: int) -> np.ndarray:
    """choose_splits for requests of ``tiles`` prefix tiles (an array): the split count minimising
    waves * (tiles the busiest split walks) * bn * NS_PER_KEY + the combine's traffic and launch, as plan_cost,
    in exact integers (COST_UNIT). A request of at most MIN_KEYS_PER_SPLIT keys (in whole tiles) takes one
    split; no split is shorter than that on average; SPLIT_MAX at most. The first minimum wins."""
    n = np.asarray(tiles, np.int64).reshape(-1, 1)
    out = np.empty(n.shape[0], np.int64)
    s = np.arange(1, SPLIT_MAX + 1, dtype=np.int64).reshape(1, -1)
    tt = -(-T // bn)
    per_key = int(NS_PER_KEY) * COST_UNIT * bn
    # plan_cost's B * rows * 4096 * s * 2 bytes at COMBINE_BYTES_PER_NS (3000 a ns), times COST_UNIT: the bytes
    combine = np.where(s > 1, B * rows * 4096 * 2 * s * COST_UNIT // int(COMBINE_BYTES_PER_NS) + int(LAUNCH_NS) * COST_UNIT, 0)
    waves = -(-(base_ctas * s) // slots)
    for i in range(0, n.shape[0], 2048):  # [chunk, SPLIT_MAX] at a time
        c = n[i:i + 2048]
        length = np.maximum(1, -(-(c + tt) // s))  # tiles a split gets
        last = c - np.minimum(c, (s - 1) * length) + tt  # the last split walks the rest and the tail
        busiest = np.where(s > 1, np.maximum(last, np.minimum(c, length)), last)
        cost = waves * busiest * per_key + combine
        allowed = s <= np.maximum(1, np.minimum(SPLIT_MAX, c * bn // MIN_KEYS_PER_SPLIT))
        cost = np.where(allowed, cost, np.iinfo(np.int64).max)
        out[i:i + 2048] = np.argmin(cost, axis=1) + 1
    out[(n[:, 0] * bn) <= MIN_KEYS_PER_SPLIT] = 1
    return out


@dataclass(frozen=True)
class SplitModel:
    """How many KV splits a request of a given prefix length takes: choose_splits with the plan's shape-only
    arguments, tabulated over every prefix tile count up to the capacity (table) for the device to look up
    at every launch; between at_least and most."""

    T: int
    """Tree nodes per request (the tail every last split walks)."""
    bn: int
    """Keys per KV tile: the table is indexed by ceil(P / bn)."""
    base_ctas: int
    """CTAs of one split over the batch (row tiles x B)."""
    rows: int
    """Query rows per request (the combine's traffic)."""
    B: int
    """Requests."""
    slots: int
    """Resident CTAs on the GPU (the waves)."""
    most: int = SPLIT_MAX
    """The grid's split count: no request takes more."""
    at_least: int = 1
    """The planted merge bug takes at least 2 (it needs a merge to show)."""
    forced: int = 0
    """Force.splits: every request takes that many (at least at_least; it may pass SPLIT_MAX, which bounds the
    model's choice and the device scheduler's, never taken with a forced count); 0: the model."""

    def counts(self, tiles) -> np.ndarray:
        """Split counts of requests of ``tiles`` prefix tiles (array)."""
        t = np.asarray(tiles, np.int64)
        c = (np.full(t.shape, self.forced, np.int64) if self.forced else
             split_counts(t.reshape(-1), self.T, self.bn, self.base_ctas, self.rows, self.B, self.slots).reshape(t.shape))
        return np.clip(c, self.at_least, max(self.most, self.forced))  # a forced count may pass SPLIT_MAX

    def count(self, prefix: int) -> int:
        """Split count of a request of ``prefix`` keys."""
        return int(self.counts(np.array([-(-prefix // self.bn)]))[0])

    def table(self, capacity: int) -> np.ndarray:
        """[ceil(capacity / bn) + 1] int32: entry n is the split count of a request of n prefix tiles (the device
        reads entry min(ceil(P / bn), last))."""
        return self.counts(np.arange(-(-capacity // self.bn) + 1)).astype(np.int32)


def plan_cost(prefix_max: int, T: int, bn: int, base_ctas: int, rows: int, B: int, slots: int, s: int,
              tile_cost: float = 1.0, fixed_tiles: float = 0.0) -> float:
    """Model, ns: waves * (keys per CTA * tile_cost + a CTA's fixed tiles) + the combine's traffic."""
    waves = math.ceil(base_ctas * s / slots)
    cost = waves * (tiles_per_split(prefix_max, T, s, bn) * tile_cost + fixed_tiles) * bn * NS_PER_KEY
    if s > 1:
        cost += B * rows * 4096 * s * 2 / COMBINE_BYTES_PER_NS + LAUNCH_NS
    return cost


ROW_TILE_SM_COST = {2: 1.10, 4: 1.0}
"""Model: an SM's time a key over 64 query rows, by the row tile running them, against the 64-row tile's. H100, 32-row
tiles two an SM against 64-row ones one an SM, on Kimi T5 B32 (40 rows, both 64 rows of work a request): 1.10-1.11x
(`mt4-short`), with a 64-row build 4-5 % slower than the shipped one, so a lower bound. Before the 64-row tile's
32-key KV tiles (`bn32`, 1.13-1.16x) it was 1.023 (`mt32-again`); DeepSeek T65 stays on 32-row tiles either way."""


def row_tile_cost(shape: Shape, device: Device, build: Build, pl: FlashPlan) -> float:
    """plan_cost of ``pl`` (``shape`` planned with ``build``), each CTA's tile priced by its share of the SM: its
    rows over 64 times the CTAs it shares the SM with, at ROW_TILE_SM_COST."""
    share = build.ctas_per_sm * build.mt / 4 * ROW_TILE_SM_COST[build.mt]
    return plan_cost(shape.capacity, shape.T, build.bn, pl.row_tiles * shape.B, shape.rows, shape.B,
                     device.sm_count * build.ctas_per_sm, pl.splits, share, CTA_FIXED_TILES)


def choose_row_tile(shape: Shape, device: Device, builds: list[Build],
                    force: Force = Force()) -> tuple[Build, FlashPlan]:
    """(build, its plan) for the build of ``builds`` (one a row tile of row_tile_choices) the model prices lowest
    (row_tile_cost), the larger tile on a tie: DeepSeek T65 (1040 rows) takes 32-row tiles, whose two CTAs an SM
    fill the waves that 17 64-row tiles a request leave ragged; T257 and T513 keep 64 rows; Kimi T5 (40 rows) takes
    one 64-row tile where its split grid fills the GPU (B32, or P128k), T9 (72 rows) three 32-row tiles."""
    plans = [(b, plan(shape, device, b, force)) for b in builds]
    if len(plans) == 1:
        return plans[0]
    return min(plans, key=lambda bp: (row_tile_cost(shape, device, *bp), -bp[0].mt))


def choose_splits(prefix_max: int, T: int, bn: int, base_ctas: int, rows: int, B: int, slots: int) -> int:
    """Split count minimising waves * keys-per-CTA + combine traffic for a prefix of ``prefix_max`` keys
    (split_counts of its tiles); slots = resident CTAs on the GPU."""
    return int(split_counts([-(-prefix_max // bn)], T, bn, base_ctas, rows, B, slots)[0])


def resident_ctas(threads: int, registers: int, smem: int, limits: ArchLimits) -> int:
    """CTAs of ``threads`` threads, ``registers`` registers a thread and ``smem`` bytes of shared memory (static and
    dynamic) an SM of ``limits`` holds at once: bounded by its registers (allocated per warp in 256s), shared memory
    (RESERVED_SMEM more a CTA, in SMEM_GRANULE units), threads and CTAs; 0 where one CTA does not fit."""
    warps = math.ceil(threads / 32)
    if smem > limits.smem_per_cta:
        return 0
    by_regs = limits.regs_per_sm // (max(256, math.ceil(registers * 32 / 256) * 256) * warps)
    by_smem = limits.smem_per_sm // (-(-(smem + RESERVED_SMEM) // SMEM_GRANULE) * SMEM_GRANULE)
    return min(by_regs, by_smem, limits.max_threads_per_sm // (32 * warps), limits.max_ctas_per_sm)


def occupancy(threads: int, registers: int, smem: int, limits: ArchLimits = SM_90) -> int:
    """Resident CTAs per SM (resident_ctas), at least 1: what the plan's waves count."""
    return max(1, resident_ctas(threads, registers, smem, limits))


def emulated_smem(threads: int, registers: int, static_smem: int, smem: int, real: ArchLimits,
                  emulated: ArchLimits) -> tuple[int, int]:
    """(CTAs an SM of ``emulated`` holds, the dynamic shared memory to ask for on ``real`` so that one of it holds as
    many) for a build of ``threads`` threads, ``registers`` registers a thread and ``static_smem`` bytes of static
    shared memory launched with ``smem`` bytes of dynamic shared memory.

    Why: a kernel meant for a small SM (sm_120: 100 KB of shared memory) timed on a large one (the H200: 228 KB)
    would have more CTAs resident an SM there than where it is meant to run (more warps to hide latency, more tiles
    in flight, fewer waves), so its times would not be the ones it gets on its own GPU. Asking for more dynamic
    shared memory than the kernel uses (it never touches the rest) holds this GPU's residency to the emulated one's.
    The request is the largest that does: the SM's shared memory shared out among exactly that many CTAs, in whole
    SMEM_GRANULE units, less the reserved KB and the static part, at most the per-CTA limit; never less than
    ``smem``. Registers, threads and the CTA cap are counted on both archs (sm_120 has the H200's 64K registers).

    ValueError, one line, where the build passes the emulated arch's per-CTA limit (it could not run there), where
    this GPU holds fewer of its CTAs than the emulated arch (no padding raises residency), or where even the
    largest request leaves more resident than the emulated arch holds."""
    need = static_smem + smem
    if need > emulated.smem_per_cta:
        raise ValueError(f"{need} bytes of shared memory a CTA (static and dynamic) pass {emulated.name}'s "
                         f"{emulated.smem_per_cta}: the build cannot run there")
    n = resident_ctas(threads, registers, need, emulated)
    if n == 0:
        raise ValueError(f"one CTA of {threads} threads at {registers} registers does not fit an SM of {emulated.name}")
    here = resident_ctas(threads, registers, need, real)
    if here < n:
        raise ValueError(f"{real.name} holds {here} CTAs an SM of this build, fewer than {emulated.name}'s {n}: "
                         f"padding shared memory cannot raise residency")
    share = real.smem_per_sm // n // SMEM_GRANULE * SMEM_GRANULE
    pad = max(smem, min(share - RESERVED_SMEM, real.smem_per_cta) - static_smem)
    got = resident_ctas(threads, registers, static_smem + pad, real)
    if got != n:
        raise ValueError(f"{pad} bytes of dynamic shared memory, the most {real.name} gives a CTA, leave {got} CTAs "
                         f"an SM resident, {emulated.name} holds {n}")
    return n, pad


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


def plan(shape: Shape, device: Device, build: Build, force: Force = Force()) -> FlashPlan:
    """Launch geometry of ``shape`` on ``device`` with ``build``; ``force`` overrides the choices it names.

    In-kernel merge (``build.merges_in_kernel``): only where every CTA is resident at once (a merging
    CTA waits for the other splits of its row tile, which must not be waiting for a slot) and each split
    merges one (row, 128-column) unit at most. Transposed rows past 64 (``build.extra_rows``): where the
    cost model says they pay (their tiles cost XR_TILE_COST), or wherever they apply with ``force.xr``.
    All rows transposed (``build.transposed_ctas_per_sm``, for a request of at most ``extra_rows`` rows):
    always; where the 64-row plan needs more than one wave, two CTAs per SM halve the waves (Kimi T1 P128k
    B32 2-7 % faster); on one-wave grids (Kimi T1 B1-B4) it streams faster and, since the combine launch
    merges few rows in 32-column chunks, ends 0.7-3.2 us sooner than the 64-row build with its in-kernel
    merge (merging in-kernel, in 32-column units, it was no faster)."""
    B, T, rows, mt, bug, cap = shape.B, shape.T, shape.rows, build.mt, build.bug, shape.capacity
    in_kernel = force.merge is Merge.IN_KERNEL  # forced: no layout that cannot merge in the kernel
    extra = 0 if force.xr is False or in_kernel else build.extra_rows
    row_tiles, xr = extra_row_tiles(rows, 16 * mt, extra)
    if build.transposed_ctas_per_sm and 0 < rows <= extra:  # its 64-row plan's splits at its residency
        tiles = plan(shape, device, Build(mt, build.bn, build.transposed_ctas_per_sm, bug), Force(splits=force.splits))
        return FlashPlan(mt, 1, tiles.splits, B, Merge.COMBINE, RowLayout.TRANSPOSED, tiles.model)
    slots = device.sm_count * build.ctas_per_sm
    chosen = force.splits or choose_splits(cap, T, build.bn, row_tiles * B, rows, B, slots)
    if xr and not force.xr:  # transposed rows only where the model says they pay
        plain = -(-rows // (16 * mt))
        plain_splits = force.splits or choose_splits(cap, T, build.bn, plain * B, rows, B, slots)
        if (plan_cost(cap, T, build.bn, plain * B, rows, B, slots, plain_splits, 1.0, CTA_FIXED_TILES)
                <= plan_cost(cap, T, build.bn, row_tiles * B, rows, B, slots, chosen, XR_TILE_COST,
                             XR_CTA_FIXED_TILES)):
            row_tiles, xr = plain, 0
    model = SplitModel(T, build.bn, row_tiles * B, rows, B, slots, at_least=merged_splits(1, bug),
                       forced=force.splits or 0)
    # the grid's, the capacity's count: a request takes its own length's, at most this (the model is jumpy
    # between near-ties: a cap at the most over every length grew grids and workspaces for nothing)
    splits = model.count(cap)
    model = replace(model, most=splits)
    units = min(rows, 16 * mt) * MERGE_UNITS_PER_ROW  # of the fullest row tile
    # rows past 64 (transposed) never merge in-kernel: they make 260+ units
    merge = (build.merges_in_kernel and force.merge is not Merge.COMBINE and not xr and splits > 1
             and units <= splits and row_tiles * splits * B <= slots)
    return FlashPlan(mt, row_tiles, splits, B, Merge.IN_KERNEL if merge else Merge.COMBINE, RowLayout(xr), model)


def choose_work_table(shape: Shape, device: Device, build: Build, pl: FlashPlan, force: Force = Force()):
    """The work table (kdtr/kernels/flash/schedule.py's Schedule, with the Recipe the device scheduler applies at
    every launch) that replaces plan ``pl``, or None to keep it: chosen at the capacity, every request at the
    longest prefix it serves. Taken where the model says it saves MIN_GAIN; never with the in-kernel merge or
    transposed rows (both find their row tile by the grid), nor, unless forced, for fewer than WORK_TABLE_ROWS
    rows or a forced split count; nor where the scheduler's table would pass its limits (MAX_TABLE_PIECES,
    MAX_TABLE_JOBS). ``force.segments``: 0 never, 1 the best cut even without a gain, N >= 2 a stream-K cut every
    N tiles."""
    from kdtr.kernels.flash import schedule

    cut = force.segments
    if (cut == 0 or not build.tile_ns or pl.merge or pl.xr or force.merge is Merge.IN_KERNEL
            or (cut is None and (shape.rows < WORK_TABLE_ROWS or force.splits))):
        return None
    model = {"fixed_tiles": CTA_FIXED_TILES, "ns_per_tile": build.tile_ns, "bytes_per_ns": COMBINE_BYTES_PER_NS,
             "launch_ns": LAUNCH_NS}
    prefix_lens = np.full(shape.B, shape.capacity, np.int64)
    jobs = schedule.jobs_of(prefix_lens, shape.T, pl.row_tiles, build.bn)
    kv_bytes = prefix_lens * DK * 2
    uniform, found = schedule.best(jobs, shape.rows, 16 * pl.mt, device.sm_count * build.ctas_per_sm, pl.splits,
                                   model, cut if cut and cut >= 2 else 0, kv_bytes, device.l2_bytes)
    if found is uniform or (build.bug == Bug.MERGE_WRONG_MAX and not found.split_jobs()):
        return None  # the planted merge bug needs a merge: the uniform plan gives it one
    if (len(jobs) > MAX_TABLE_JOBS
            or found.recipe.max_pieces(len(jobs), max(j.work for j in jobs)) > MAX_TABLE_PIECES):
        return None
    return found if cut or found.cost_ns + SCHEDULER_NS < uniform.cost_ns * (1 - schedule.MIN_GAIN) else None
