"""The work table: a flash-sm90 launch as a list of (request, row tile, key range) pieces, balanced over the SMs.

Why: uniform splits give every (request, row tile) job the same number of equal pieces, so 136 jobs
on 132 SMs run two waves where 1.03 would do (DeepSeek T65 P8k B8: 544 CTAs, 4.12 waves, the fifth
nearly empty). Here a job's prefix tiles are cut anywhere on a tile boundary, the pieces go out
longest first (the hardware starts each CTA, in grid order, on the first
SM to free up), and a job left in one piece writes its output directly: only cut jobs leave partials
for the combine (``kdtr_flash_combine_jobs``, cuda/flash_split.cuh).

Pure arithmetic on the shape (testable without a GPU). The cost model is kdtr/kernels/flash/plan.py's (a CTA costs
its tiles plus CTA_FIXED_TILES; the combine moves the partials at COMBINE_BYTES_PER_NS), evaluated
by simulating the in-order dispatch on every SM, for the uniform plan and for each candidate cut;
the work table is taken only where it beats the uniform plan by MIN_GAIN.

Graph safety: the host chooses a Recipe (which cut, how many CTAs it aims at) once, at the plan's
capacity (every request at the longest prefix it serves); the device scheduler of cuda/flash_sched.cuh
applies that recipe to the real prefix lengths at every launch. ``recipe_pieces``, ``longest_first`` and
``Schedule.tables`` are the scheduler's exact mirror (integer arithmetic throughout; a GPU test compares
the tables bit for bit), and at the capacity they give the table the host chose.

L2: the row tiles of a request read the same KV. Cut at the same key boundaries and dispatched side
by side, they stream it from HBM once; cut at drifting boundaries (stream-K proper), each reads it
on its own, which the model does not price: measured, DeepSeek T65 P128k B1 went 630 ->
686 us that way (151 MB of KV per request, 60 MB of L2). So drifting cuts are tried only where the
KV of the requests they cut fits in L2; aligned cuts (a key range per request, run by all its row
tiles) everywhere.
"""

from __future__ import annotations

import enum
import heapq
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from kdtr.inputs.presets import DV

WORK_FIELDS = ("b", "rt", "lo", "hi", "tail", "slot")
"""One row of the main kernel's work table (int32): request, row tile, prefix keys [lo, hi), 1 if
the piece also walks the tree tail, partial slot (-1: writes out and lse directly). The kernel
reads them in this order (cuda/flash_sm90.cu, its config's WORK_INTS)."""
JOB_FIELDS = ("b", "r0", "slot0", "count")
"""One row of the combine's job table (int32): request, first row, first partial slot, slots (cuda/flash_split.cuh)."""
MAX_PIECES = 256
"""Pieces of one cut job at most (the combine's partial traffic grows with them; uniform splits stop at 256 too)."""
MIN_GAIN = 0.03
"""A work table replaces the uniform plan only when the model says it saves at least this fraction."""
WHOLE_MAX_TILES = 1100
"""Whole jobs (one CTA walking a request's whole prefix) only up to this many tiles. Measured (H200,
DeepSeek T65 B8): 1027-tile jobs (P32k) ran at the model's pace, 1340 -> 1212 us; 4099-tile jobs
(P128k) did not (4744-4779 -> 4774 us, the model said 8 % less): a request's row tiles drift apart
over a long walk and stop sharing the KV in L2, and at one tile per ~1.06 us per SM the
unshared reads would need ~4.5 TB/s."""


@dataclass(frozen=True)
class Job:
    """One (request, row tile): the unit uniform splits cut into equal pieces."""

    b: int
    """Request."""
    rt: int
    """Row tile (rows 64 rt .. 64 rt + 63)."""
    pre: int
    """Prefix tiles: ceil(P_b / bn)."""
    tail: int
    """Tree-tail tiles, walked whole by the job's last piece: ceil(T / bn)."""

    @property
    def work(self) -> int:
        """Tiles the whole job walks."""
        return self.pre + self.tail


@dataclass(frozen=True)
class Piece:
    """Prefix tiles [lo, hi) of one job, plus the tree tail when it is the job's last piece."""

    job: int
    """Index into the schedule's jobs."""
    lo: int
    """First prefix tile."""
    hi: int
    """One past the last prefix tile."""
    tail: bool
    """Walks the tree tail too (the job's last piece)."""


class Family(enum.IntEnum):
    """The cuts a Recipe names (cuda/flash_sched.cuh's enum SchedFamily mirrors it; a test keeps them equal)."""

    ALIGNED = 0
    """Each request's row tiles cut at the same keys into a split count in proportion to its work (aligned)."""
    WHOLE = 1
    """The first ``whole`` jobs by size walked whole by one CTA each, the rest ALIGNED."""
    STREAM = 2
    """Stream-K: the jobs' work laid end to end and cut every total / parts (or every interval) tiles."""


@dataclass(frozen=True)
class Recipe:
    """How the device scheduler cuts a launch's jobs into pieces (the host's choice at the capacity)."""

    family: Family
    """Which cut."""
    target: int
    """ALIGNED, WHOLE: the CTAs the aligned cut aims at (slots x waves); STREAM: the parts the work is cut into
    (when interval is 0)."""
    interval: int = 0
    """STREAM: a cut every this many tiles instead (a forced cut, for tests and experiments); 0: total / target."""
    whole: int = 0
    """WHOLE: jobs walked whole, a multiple of the resident CTAs."""

    @property
    def label(self) -> str:
        if self.family is Family.STREAM:
            return f"stream-k@{self.interval}" if self.interval else f"stream-k/{self.target}"
        return f"{'whole+' if self.family is Family.WHOLE else ''}aligned/{self.target}"

    def max_pieces(self, n_jobs: int, max_job_tiles: int) -> int:
        """Pieces the recipe makes at most, whatever the prefix lengths (jobs of at most ``max_job_tiles`` tiles,
        for a forced interval): the scheduler's grid and table rows. ALIGNED (and WHOLE's rest): a request's split
        count is at most its share of the target, rounded, plus one, so target + 1.5 jobs."""
        if self.family is Family.STREAM:
            cuts = self.target - 1 if not self.interval else n_jobs * max_job_tiles // self.interval
            return n_jobs + cuts
        return self.target + 2 * n_jobs


@dataclass(frozen=True)
class Schedule:
    """Pieces in dispatch order (one CTA each) and what the model says they cost."""

    jobs: tuple[Job, ...]
    """Every (request, row tile)."""
    pieces: tuple[Piece, ...]
    """One CTA each, in grid order."""
    cost_ns: float
    """Model: the last SM's finish (simulated dispatch) plus the combine."""
    label: str
    """Which cut made it (for logs and the docs)."""
    recipe: Recipe | None = None
    """The recipe that made it (None: the uniform plan)."""

    @cached_property
    def counts(self) -> np.ndarray:
        """[jobs] pieces of each job."""
        return pieces_per_job(len(self.jobs), self.pieces)

    def split_jobs(self) -> list[int]:
        """Jobs cut into more than one piece, in job order: the combine's jobs."""
        return [int(j) for j in np.flatnonzero(self.counts > 1)]

    @property
    def slots(self) -> int:
        """Partial slots: one per piece of a cut job."""
        return int(self.counts[self.counts > 1].sum())

    def tables(self, P: np.ndarray, bn: int, rows_per_tile: int) -> tuple[np.ndarray, np.ndarray]:
        """(work [pieces, WORK_FIELDS], jobs [cut jobs, JOB_FIELDS]) as int32; P: [B] prefix lengths.
        A cut job's slots are consecutive in tile order."""
        by_job: dict[int, list[int]] = {}
        for i, p in enumerate(self.pieces):
            by_job.setdefault(p.job, []).append(i)
        slot_of, job_rows, next_slot = {}, [], 0
        for j in self.split_jobs():
            order = sorted(by_job[j], key=lambda i: self.pieces[i].lo)
            job_rows.append((self.jobs[j].b, self.jobs[j].rt * rows_per_tile, next_slot, len(order)))
            for k, i in enumerate(order):
                slot_of[i] = next_slot + k
            next_slot += len(order)
        work = np.zeros((len(self.pieces), len(WORK_FIELDS)), np.int32)
        for i, p in enumerate(self.pieces):
            job, Pb = self.jobs[p.job], int(P[self.jobs[p.job].b])
            hi = Pb if p.tail else min(Pb, p.hi * bn)
            work[i] = (job.b, job.rt, min(Pb, p.lo * bn), hi, int(p.tail), slot_of.get(i, -1))
        return work, np.array(job_rows, np.int32).reshape(-1, len(JOB_FIELDS))

    def workspace_bytes(self, rows_per_tile: int) -> int:
        """fp32 partial out [slots, rows_per_tile, 512] + partial lse [slots, rows_per_tile]."""
        return self.slots * rows_per_tile * (DV + 1) * 4


def jobs_of(P: np.ndarray, T: int, row_tiles: int, bn: int) -> tuple[Job, ...]:
    """Every (request, row tile) of a launch, request-major."""
    tail = -(-T // bn)
    return tuple(Job(b, rt, -(-int(p) // bn), tail) for b, p in enumerate(P) for rt in range(row_tiles))


def tiles(job: Job, piece: Piece) -> int:
    """Tiles one piece walks."""
    return piece.hi - piece.lo + (job.tail if piece.tail else 0)


def pieces_per_job(n_jobs: int, pieces) -> np.ndarray:
    """[n_jobs] how many pieces each job is cut into."""
    return np.bincount([p.job for p in pieces], minlength=n_jobs)


def finish_tiles(jobs, pieces, slots: int, fixed_tiles: float) -> float:
    """Model: when the last SM finishes, in tiles, with each piece started in order on the first free
    SM (slots CTAs resident at once) and costing its tiles + fixed_tiles."""
    free = [0.0] * slots
    end = 0.0
    for p in pieces:
        t = heapq.heappop(free) + tiles(jobs[p.job], p) + fixed_tiles
        end = max(end, t)
        heapq.heappush(free, t)
    return end


def combine_ns(jobs, pieces, rows: int, rows_per_tile: int, bytes_per_ns: float, launch_ns: float) -> float:
    """Model: the cut jobs' fp32 partial rows written and read once, plus the combine launch."""
    counts = pieces_per_job(len(jobs), pieces)
    cut = np.flatnonzero(counts > 1)
    if not len(cut):
        return 0.0
    part_rows = sum(int(counts[j]) * min(rows_per_tile, rows - jobs[j].rt * rows_per_tile) for j in cut)
    return part_rows * DV * 4 * 2 / bytes_per_ns + launch_ns


def uniform_pieces(jobs, splits: int) -> list[Piece]:
    """The uniform plan's CTAs in its grid order (row tile fastest, then split, then request): every
    job cut as cuda/flash_split.cuh's split_keys cuts it (ceil((pre + tail) / splits) tiles a split)."""
    return split_pieces(jobs, {job.b: splits for job in jobs})


def split_pieces(jobs, splits_of: dict[int, int], order=None) -> list[Piece]:
    """Aligned cuts: request b's jobs (its row tiles, same prefix) all cut into splits_of[b] equal
    pieces at the same boundaries, as split_keys cuts them; pieces listed (request, split, row tile)
    so that a stable longest-first sort keeps one key range's row tiles side by side (L2)."""
    by_b: dict[int, list[int]] = {}
    for j in order if order is not None else range(len(jobs)):
        by_b.setdefault(jobs[j].b, []).append(j)
    out = []
    for b, mine in by_b.items():
        splits = splits_of[b]
        for s in range(splits):
            for j in mine:
                job = jobs[j]
                length = max(1, -(-job.work // splits))
                lo = min(job.pre, s * length)
                hi = job.pre if s == splits - 1 else min(job.pre, lo + length)
                if hi > lo or s == splits - 1:
                    out.append(Piece(j, lo, hi, s == splits - 1))
    return out


def stream_cut(k: int, total: int, parts: int, interval: int) -> int:
    """Where stream-K cut k (k >= 1) falls, in tiles from the start of the work laid end to end."""
    return k * interval if interval else k * total // parts


def cut_stream(jobs, order, interval: int = 0, parts: int = 0) -> list[Piece]:
    """Stream-K cut: the jobs' work laid end to end (in ``order``; prefix tiles, then the tail as one block)
    and cut every ``interval`` tiles, or at k * total // parts for k = 1 .. parts - 1, and at every job's end.
    A cut inside a tail moves to its start. Integer arithmetic, as the device scheduler's."""
    if not interval and parts < 1:
        raise ValueError("cut_stream: give an interval or parts >= 1")
    total = sum(jobs[j].work for j in order)
    out, pos = [], 0
    for j in order:
        job = jobs[j]
        # the first cut past pos: k * interval > pos, or k * total // parts > pos (k * total >= (pos + 1) * parts)
        k = pos // interval + 1 if interval else -(-(pos + 1) * parts // total)
        lo = 0
        while stream_cut(k, total, parts, interval) < pos + job.work:
            c = min(stream_cut(k, total, parts, interval) - pos, job.pre)
            if c > lo:
                out.append(Piece(j, lo, c, False))
                lo = c
            k += 1
        out.append(Piece(j, lo, job.pre, True))
        pos += job.work
    return out


def longest_first(jobs, pieces) -> list[Piece]:
    """Dispatch order: pieces by tiles, longest first (stable), so short pieces fill in behind."""
    return sorted(pieces, key=lambda p: -tiles(jobs[p.job], p))


def aligned(jobs, order, pieces_target: int) -> list[Piece]:
    """Aligned cuts of the jobs in ``order`` into about pieces_target CTAs: request b gets splits in
    proportion to its work, round(target * its job's tiles / total), half up, at least 1, at most MAX_PIECES and
    its job's tiles (integers, as the device scheduler)."""
    work: dict[int, int] = {}
    rows: dict[int, int] = {}
    for j in order:
        work[jobs[j].b] = work.get(jobs[j].b, 0) + jobs[j].work
        rows[jobs[j].b] = rows.get(jobs[j].b, 0) + 1
    total = sum(work.values())
    splits = {b: max(1, min(MAX_PIECES, work[b] // rows[b], (2 * pieces_target * (work[b] // rows[b]) + total) // (2 * total)))
              for b in work}
    return split_pieces(jobs, splits, order)


def by_size(jobs) -> list[int]:
    """Jobs by work, longest first, ties in job order: requests by length, their row tiles in order."""
    return sorted(range(len(jobs)), key=lambda j: (-jobs[j].work, j))


def recipe_pieces(jobs, recipe: Recipe) -> list[Piece]:
    """The pieces ``recipe`` cuts ``jobs`` into, in list order (longest_first then orders them for dispatch)."""
    if recipe.family is Family.STREAM:
        return cut_stream(jobs, range(len(jobs)), recipe.interval, recipe.target)
    if recipe.family is Family.ALIGNED:
        return aligned(jobs, range(len(jobs)), recipe.target)
    ranked = by_size(jobs)
    head = [Piece(j, 0, jobs[j].pre, True) for j in ranked[:recipe.whole]]
    rest = sorted(ranked[recipe.whole:])
    return head + (aligned(jobs, rest, recipe.target) if rest else [])


def device_schedule(P, T: int, row_tiles: int, bn: int, recipe: Recipe) -> Schedule:
    """What the device scheduler (cuda/flash_sched.cuh) makes of ``recipe`` at prefix lengths ``P``: the pieces
    in dispatch order (Schedule.tables gives its work and job tables)."""
    jobs = jobs_of(np.asarray(P), T, row_tiles, bn)
    return Schedule(jobs, tuple(longest_first(jobs, recipe_pieces(jobs, recipe))), 0.0, recipe.label, recipe)


def candidates(jobs, slots: int, fits_l2):
    """(Recipe, pieces) of the cuts tried. Aligned: a split count per request, for about 1-4 waves of
    CTAs; where there are more jobs than SMs, whole jobs for the first multiple of the SM count (they
    write out directly) and the rest aligned. Drifting (stream-K intervals)
    only where fits_l2(requests) says the KV of the requests they cut fits in L2."""
    total = sum(j.work for j in jobs)
    for waves in range(1, 5):
        r = Recipe(Family.ALIGNED, slots * waves)
        yield r, recipe_pieces(jobs, r)
        if total >= slots * waves and fits_l2({j.b for j in jobs}):
            r = Recipe(Family.STREAM, slots * waves)
            yield r, recipe_pieces(jobs, r)
    whole = len(jobs) // slots * slots
    if whole and whole < len(jobs) and max(j.work for j in jobs) <= WHOLE_MAX_TILES:
        for waves in range(1, 4):
            r = Recipe(Family.WHOLE, slots * waves, whole=whole)
            yield r, recipe_pieces(jobs, r)


def best(jobs, rows: int, rows_per_tile: int, slots: int, uniform_splits: int, model: dict,
         forced_interval: int = 0, kv_bytes=None, l2_bytes: int = 0) -> tuple[Schedule, Schedule]:
    """(uniform plan, best work table) under the model; ``forced_interval`` > 0 cuts stream-K every that
    many tiles whatever it costs (experiments and tests). model: fixed_tiles, ns_per_tile,
    bytes_per_ns, launch_ns. kv_bytes[b]: request b's KV bytes; drifting cuts need their sum over
    the cut requests <= l2_bytes (none without them)."""

    def fits_l2(requests) -> bool:
        return kv_bytes is not None and sum(int(kv_bytes[b]) for b in requests) <= l2_bytes

    def priced(recipe, pieces) -> Schedule:
        end = finish_tiles(jobs, pieces, slots, model["fixed_tiles"]) * model["ns_per_tile"]
        comb = combine_ns(jobs, pieces, rows, rows_per_tile, model["bytes_per_ns"], model["launch_ns"])
        return Schedule(jobs, tuple(pieces), end + comb, recipe.label if recipe else f"uniform/{uniform_splits}",
                        recipe)

    uniform = priced(None, uniform_pieces(jobs, uniform_splits))
    if forced_interval > 0:
        r = Recipe(Family.STREAM, 0, interval=forced_interval)
        return uniform, priced(r, longest_first(jobs, recipe_pieces(jobs, r)))
    found = None
    for recipe, pieces in candidates(jobs, slots, fits_l2):
        if pieces_per_job(len(jobs), pieces).max() > MAX_PIECES:
            continue
        s = priced(recipe, longest_first(jobs, pieces))
        if found is None or s.cost_ns < found.cost_ns:
            found = s
    return uniform, found or uniform
