"""The work table (kdtr/kernels/flash/schedule.py) and its choice (kdtr/kernels/flash/plan.py's
choose_work_table): pure arithmetic, no GPU."""

import numpy as np
import pytest

from kdtr.kernels.bugs import Bug
from kdtr.kernels.flash import schedule
from kdtr.kernels.flash.force import Force
from kdtr.kernels.flash.kernel import FLASH_SM90
from kdtr.kernels.flash.plan import Build, Device, Shape, choose_work_table, plan, split_range

SMS, BN = 132, 32
L2 = 60 * 2**20  # H200 (the device reports 62 914 560 B)
MODEL = {"fixed_tiles": 4.7, "ns_per_tile": 1060.0, "bytes_per_ns": 3000.0, "launch_ns": 3000.0}

SHAPES = {  # (T, H, prefix lengths)
    "deepseek-t65-p8k-b8": (65, 16, (8192,) * 8),
    "deepseek-t65-p32k-b1": (65, 16, (32768,)),
    "mixed-with-empty": (65, 16, (1500, 0, 333, 2900, 31, 32)),
    "t17-short": (17, 16, (700, 64)),
}


def cuts(shape):
    T, H, P = SHAPES[shape]
    rows = T * H
    jobs = schedule.jobs_of(np.array(P), T, -(-rows // 64), BN)
    yield "uniform/4", jobs, schedule.uniform_pieces(jobs, 4)
    for recipe, pieces in schedule.candidates(jobs, SMS, lambda requests: True):
        yield recipe.label, jobs, pieces
    yield "every-3", jobs, schedule.cut_stream(jobs, range(len(jobs)), 3)
    yield "parts-7", jobs, schedule.cut_stream(jobs, range(len(jobs)), parts=7)


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_every_cut_walks_each_key_of_each_job_once(shape):
    """Pieces of a job are contiguous prefix-tile ranges covering [0, pre) with no overlap, and
    exactly one of them, the last, walks the tree tail: no key is lost or counted twice."""
    for label, jobs, pieces in cuts(shape):
        for j, job in enumerate(jobs):
            mine = sorted((p for p in pieces if p.job == j), key=lambda p: (p.lo, p.hi))
            assert mine, (label, j)
            assert mine[0].lo == 0 and mine[-1].hi == job.pre, (label, j, mine)
            assert all(a.hi == b.lo for a, b in zip(mine, mine[1:])), (label, j, mine)
            assert [p.tail for p in mine] == [False] * (len(mine) - 1) + [True], (label, j, mine)
            assert all(p.hi > p.lo for p in mine[:-1]), (label, j)


def test_uniform_pieces_are_the_kernels_split_ranges():
    """The model prices the uniform plan with the partition cuda/flash_split.cuh's split_keys walks
    (kdtr/kernels/flash/plan.py split_range, which a GPU test ties to the kernel)."""
    for P, T, splits in [(8192, 65, 4), (3100, 41, 7), (0, 9, 3), (100, 513, 4)]:
        jobs = schedule.jobs_of(np.array([P]), T, 1, BN)
        pieces = {p.lo: p for p in schedule.uniform_pieces(jobs, splits)}
        for s in range(splits):
            lo, hi = split_range(P, T, splits, BN, s)
            if hi == lo and s < splits - 1:
                continue
            p = pieces[-(-lo // BN)]
            assert (min(P, p.lo * BN), P if p.tail else min(P, p.hi * BN)) == (lo, hi)


def test_tables_give_each_cut_job_consecutive_slots_and_whole_jobs_none():
    T, H, P = SHAPES["mixed-with-empty"]
    Pa = np.array(P)
    jobs = schedule.jobs_of(Pa, T, 17, BN)
    _, s = schedule.best(jobs, T * H, 64, SMS, 4, MODEL, forced_interval=20)
    work, job_rows = s.tables(Pa, BN, 64)
    assert work.shape == (len(s.pieces), len(schedule.WORK_FIELDS)) and work.dtype == np.int32
    f = {n: work[:, i] for i, n in enumerate(schedule.WORK_FIELDS)}
    assert (f["lo"] <= f["hi"]).all() and (f["hi"] <= Pa[f["b"]]).all()
    assert ((f["lo"] % BN == 0) | (f["lo"] == f["hi"])).all()  # tile starts, or an empty range (a tail-only piece)
    assert (f["hi"][f["tail"] == 1] == Pa[f["b"][f["tail"] == 1]]).all()  # the tail piece ends the prefix
    assert len(job_rows) == len(s.split_jobs()) and job_rows[:, 3].sum() == s.slots
    assert sorted(f["slot"][f["slot"] >= 0]) == list(range(s.slots))
    for b, r0, slot0, count in job_rows:
        mine = work[(f["b"] == b) & (f["rt"] == r0 // 64)]
        assert len(mine) == count > 1
        order = np.argsort(mine[:, 2])
        assert list(mine[order, 5]) == list(range(slot0, slot0 + count))  # slots in key order
    whole = [j for j in range(len(jobs)) if j not in s.split_jobs()]
    for j in whole:
        row = work[(f["b"] == jobs[j].b) & (f["rt"] == jobs[j].rt)]
        assert len(row) == 1 and row[0, 5] == -1 and row[0, 2] == 0 and row[0, 4] == 1
    assert s.workspace_bytes(64) == s.slots * 64 * 513 * 4


def test_dispatch_model_starts_each_piece_on_the_first_free_sm():
    jobs = (schedule.Job(0, 0, 10, 0), schedule.Job(0, 1, 6, 0), schedule.Job(0, 2, 4, 0))
    pieces = [schedule.Piece(j, 0, jobs[j].pre, True) for j in range(3)]
    assert schedule.finish_tiles(jobs, pieces, 2, 1.0) == 12.0  # 11 | 7 + 5: the short SM takes the third
    assert schedule.finish_tiles(jobs, pieces[1:] + pieces[:1], 2, 1.0) == 16.0  # 7 | 5 + 11: longest last


def test_longest_first():
    jobs = (schedule.Job(0, 0, 10, 1),)
    pieces = schedule.cut_stream(jobs, [0], 4)
    ordered = schedule.longest_first(jobs, pieces)
    sizes = [schedule.tiles(jobs[0], p) for p in ordered]
    assert sizes == sorted(sizes, reverse=True) and sum(sizes) == 11


def flash_sm90_build(bug=0, tile_ns=FLASH_SM90.tile_ns) -> Build:
    """flash-sm90's 64-row build on an H200, one CTA an SM; no all-transposed build."""
    return Build(4, BN, 1, bug, True, 8, 0, tile_ns)


def flash_sm90_plan(T, H, P, bug=0, **force):
    return plan(Shape(len(P), T, H, max(P)), Device(SMS, L2), flash_sm90_build(bug), Force(**force))


def table(T, H, P, pl, bug=0, l2=L2, tile_ns=FLASH_SM90.tile_ns, **force):
    """choose_work_table for a batch of len(P) requests at the capacity max(P) and plan pl; ``force``: Force's fields."""
    return choose_work_table(Shape(len(P), T, H, max(P)), Device(SMS, l2), flash_sm90_build(bug, tile_ns), pl,
                             Force(**force))


def test_the_136_job_grid_takes_whole_jobs_and_spreads_the_rest():
    """DeepSeek T65 P8k B8: uniform splits launch 544 CTAs, 4.12 waves; the work table runs 132
    whole jobs and spread the other 4 over every SM: the model says ~25 % less."""
    T, H, P = SHAPES["deepseek-t65-p8k-b8"]
    pl = flash_sm90_plan(T, H, P)
    seg = table(T, H, P, pl)
    assert seg is not None and seg.label.startswith("whole+aligned")
    assert len(seg.split_jobs()) == 4 and sum(p.tail and p.lo == 0 for p in seg.pieces) >= 132
    cut = [p for p in seg.pieces if p.job in seg.split_jobs()]
    bounds = {j: sorted(p.lo for p in cut if p.job == j) for j in seg.split_jobs()}
    assert len({tuple(b) for b in bounds.values()}) == 1  # one request's row tiles cut alike: its KV read once
    jobs = schedule.jobs_of(np.array(P), T, pl.row_tiles, BN)
    uniform, _ = schedule.best(jobs, T * H, 64, SMS, pl.splits, MODEL)
    assert seg.cost_ns < 0.8 * uniform.cost_ns


@pytest.mark.parametrize("T, H, P", [
    (1, 8, (32768,)),          # decode: merges in-kernel
    (1, 8, (32768,) * 32),     # decode rows: the model was measured on 64-row tiles
    (9, 8, (32768,) * 32),     # transposed rows
    (257, 16, (8192,)),        # two splits balance already
    (513, 16, (8192,) * 8),    # 1.0 % by the model: under MIN_GAIN
    (65, 16, (131072,) * 8),   # whole jobs of 4099 tiles: measured no faster (WHOLE_MAX_TILES)
    (65, 16, (131072,)),       # drifting cuts of 151 MB of KV: measured slower (L2)
])
def test_the_work_table_stays_out_where_the_uniform_plan_is_as_good(T, H, P):
    assert table(T, H, P, flash_sm90_plan(T, H, P)) is None


def test_drifting_cuts_only_where_the_cut_kv_fits_in_l2():
    """Stream-K cuts put a request's row tiles at different keys, so each reads the KV from HBM on
    its own: DeepSeek T65 P128k B1 (151 MB of KV) measured 630 -> 686 us that way. P32k (38 MB)
    measured 185 -> 177 us (segments=1: the best cut whatever it gains)."""
    T, H = 65, 16
    for P, l2, drifting in [(131072, L2, False), (32768, L2, True), (131072, 10 * L2, True)]:
        pl = flash_sm90_plan(T, H, (P,))
        seg = table(T, H, (P,), pl, l2=l2, segments=1)
        assert (seg is not None and seg.label.startswith("stream-k")) == drifting, (P, l2, seg and seg.label)


def test_the_work_table_must_pay_for_its_device_scheduler():
    """The scheduler costs ~20 us a launch before the main kernel (SCHEDULER_NS): DeepSeek T65 P32k B1's
    stream-K cut, ~7 us better than the uniform plan by the model, no longer pays; P8k B8's ~110 us does."""
    from kdtr.kernels.flash.plan import SCHEDULER_NS

    assert SCHEDULER_NS >= 20_000
    assert table(65, 16, (32768,), flash_sm90_plan(65, 16, (32768,))) is None
    T, H, P = SHAPES["deepseek-t65-p8k-b8"]
    assert table(T, H, P, flash_sm90_plan(T, H, P)) is not None


def test_a_forced_split_count_keeps_the_uniform_plan():
    T, H, P = SHAPES["deepseek-t65-p8k-b8"]
    pl = flash_sm90_plan(T, H, P, splits=7)
    assert table(T, H, P, pl, splits=7) is None
    assert table(T, H, P, pl, splits=7, segments=1) is not None  # unless the work table is forced too


def test_forcing_the_work_table():
    T, H, P = SHAPES["t17-short"]
    pl = flash_sm90_plan(T, H, P)
    assert table(T, H, P, pl, l2=0, segments=0) is None
    every = table(T, H, P, pl, l2=0, segments=2)
    assert every is not None and max(schedule.tiles(every.jobs[p.job], p) for p in every.pieces if not p.tail) <= 2
    assert table(T, H, P, pl, l2=0, tile_ns=0.0, segments=2) is None  # the kernel takes no work table
    assert table(T, H, P, pl, l2=0, segments=1) is not None  # the best cut even without a gain
    merged = flash_sm90_plan(1, 8, (32768,))
    assert merged.merge and table(1, 8, (32768,), merged, l2=0, segments=1) is None


def test_the_merge_bug_keeps_a_cut_job_or_the_uniform_plan():
    """The planted merge bug needs a merge: a work table without a cut job gives way to the uniform plan
    (which forces two splits)."""
    T, H = 65, 16
    pl = flash_sm90_plan(T, H, (64,) * 8, bug=Bug.MERGE_WRONG_MAX)
    assert pl.splits == 2
    whole = table(T, H, (64,) * 8, pl, bug=Bug.MERGE_WRONG_MAX, l2=0, segments=40)
    assert whole is None  # every job fits one 40-tile piece: nothing to merge
    forced = table(T, H, (700,) * 8, pl, bug=Bug.MERGE_WRONG_MAX, l2=0, segments=3)
    assert forced is not None and forced.split_jobs()


def test_table_rows_are_as_wide_as_the_kernels_read_them():
    """WORK_INTS / JOB_INTS of cuda/flash_split.cuh equal the field lists written here (the launcher
    also checks the compiled module's config at run time)."""
    import re

    from kdtr.kernels.nvrtc import CUDA_DIR

    text = (CUDA_DIR / "flash_sched.cuh").read_text()
    ints = {k: int(v) for k, v in re.findall(r"constexpr int (WORK_INTS|JOB_INTS) = (\d+);", text)}
    assert ints == {"WORK_INTS": len(schedule.WORK_FIELDS), "JOB_INTS": len(schedule.JOB_FIELDS)}



def test_the_device_mirror_gives_the_hosts_table_at_the_capacity():
    """The host chooses a recipe with every request at the capacity; the device scheduler applies it to the
    real lengths (schedule.device_schedule is its mirror): at the capacity it is the very table the host chose."""
    for T, H, P, force in [(*SHAPES["deepseek-t65-p8k-b8"], {}), (*SHAPES["deepseek-t65-p32k-b1"], {"segments": 1}),
                           (65, 16, (32768,) * 8, {})]:
        pl = flash_sm90_plan(T, H, P)
        chosen = table(T, H, P, pl, **force)
        assert chosen is not None and chosen.recipe is not None
        mirror = schedule.device_schedule(P, T, pl.row_tiles, BN, chosen.recipe)
        assert mirror.pieces == chosen.pieces and mirror.jobs == chosen.jobs
        for a, b in zip(mirror.tables(np.array(P), BN, 64), chosen.tables(np.array(P), BN, 64)):
            assert np.array_equal(a, b)


@pytest.mark.parametrize("recipe", [
    schedule.Recipe(schedule.Family.ALIGNED, SMS), schedule.Recipe(schedule.Family.ALIGNED, 4 * SMS),
    schedule.Recipe(schedule.Family.WHOLE, SMS, whole=SMS), schedule.Recipe(schedule.Family.STREAM, SMS),
    schedule.Recipe(schedule.Family.STREAM, 0, interval=7)], ids=lambda r: r.label)
def test_a_recipe_cuts_any_lengths_within_its_bound(recipe):
    """Replayed at lengths the host never saw (shorter, mixed, zero), a recipe still walks every key of every
    job once, and makes no more pieces than max_pieces, the grid and table rows the launch reserved."""
    rng = np.random.default_rng(7)
    T, H, cap = 65, 16, 8192
    row_tiles = -(-T * H // 64)
    for trial in range(40):
        B = int(rng.integers(8, 12))  # >= 136 jobs: the WHOLE recipe's head fits
        P = rng.integers(0, cap + 1, B) if trial % 4 else np.full(B, int(rng.integers(0, 3)))
        s = schedule.device_schedule(P, T, row_tiles, BN, recipe)
        max_tiles = -(-cap // BN) + -(-T // BN)
        assert len(s.pieces) <= recipe.max_pieces(len(s.jobs), max_tiles)
        for j, job in enumerate(s.jobs):
            mine = sorted((p for p in s.pieces if p.job == j), key=lambda p: (p.lo, p.hi))
            assert mine[0].lo == 0 and mine[-1].hi == job.pre and mine[-1].tail
            assert all(a.hi == b.lo for a, b in zip(mine, mine[1:]))
        sizes = [schedule.tiles(s.jobs[p.job], p) for p in s.pieces]
        assert sizes == sorted(sizes, reverse=True)
