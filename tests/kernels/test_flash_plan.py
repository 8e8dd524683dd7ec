"""The flash kernel's launch plan (pure arithmetic, no GPU)."""

import numpy as np
import pytest

from kdtr.kernels.bugs import Bug
from kdtr.kernels.flash.force import Force, Merge, RowLayout
from kdtr.kernels.flash.arch import SM_90, SM_120, ArchLimits
from kdtr.kernels.flash.plan import (Build, Device, Shape, choose_row_tile, emulated_smem, occupancy, plan, resident_ctas,
                                    row_tile_choices)

H200_SMS = 132
BN = 32  # flash-sm90's KV tile (the plan reads it from the compiled module)


def plan_of(B, T, H, prefix_max, mt=None, ctas_per_sm=1, bug=0, can_merge=False, extra_rows=0, transposed_ctas_per_sm=0,
            sm_count=H200_SMS, **force):
    """plan() of one shape on an H200-sized GPU with flash-sm90's KV tile; ``force``: Force's fields."""
    build = Build(mt or max(row_tile_choices(T * H)), BN, ctas_per_sm, bug, can_merge, extra_rows, transposed_ctas_per_sm)
    return plan(Shape(B, T, H, prefix_max), Device(sm_count), build, Force(**force))


@pytest.mark.parametrize("rows, mts", [(1, (1,)), (16, (1,)), (17, (2,)), (32, (2,)), (33, (2, 4)), (72, (2, 4)),
                                       (129, (2, 4)), (16 * 1025, (2, 4))])
def test_row_tile_choices_by_rows(rows, mts):
    assert row_tile_choices(rows) == mts


@pytest.mark.parametrize("T, B, P, want", [(5, 32, 32768, 4), (5, 32, 131072, 4), (5, 1, 131072, 4), (5, 1, 32768, 2),
                                           (9, 32, 32768, 2), (9, 32, 131072, 2), (9, 1, 131072, 2)])
def test_the_model_picks_the_row_tile_mt4_short_measured_faster(T, B, P, want):
    """flash's shipped tiles (32-row: 16 keys, two an SM; 64-row: 32 keys, one an SM) on Kimi trees (H = 8): `mt4-short`
    measured the one 64-row tile 1.10-1.11x faster on T5 (40 rows) B32 and 1.07x on T5 P128k B1 (level at P32k B1),
    three 32-row tiles 1.08-1.23x faster on T9 (72 rows)."""
    builds = [Build(2, 16, 2), Build(4, 32, 1)]
    assert choose_row_tile(Shape(B, T, 8, P), Device(H200_SMS), builds)[0].mt == want


@pytest.mark.parametrize("T, want", [(65, 2), (257, 4), (513, 4)])
@pytest.mark.parametrize("B", [1, 8])
@pytest.mark.parametrize("P", [8192, 32768, 131072])
def test_the_model_picks_the_compute_sets_row_tile_as_measured(T, want, B, P):
    """The shipped tiles as above on DeepSeek (H = 16): T65 (1040 rows) on the 32-row tiles `mt-by-model` measured
    1.05-1.29x faster, T257 / T513 on the 64-row tiles (32-row ones 0.96-0.99x before `bn32` made these 1.13-1.16x)."""
    builds = [Build(2, 16, 2), Build(4, 32, 1)]
    assert choose_row_tile(Shape(B, T, 16, P), Device(H200_SMS), builds)[0].mt == want


def test_a_single_row_tile_is_taken_unpriced():
    only = Build(4, 16, 1)
    build, pl = choose_row_tile(Shape(1, 65, 16, 8192), Device(H200_SMS), [only])
    assert build is only and pl == plan(Shape(1, 65, 16, 8192), Device(H200_SMS), only)


def test_one_long_request_fills_the_gpu_with_splits():
    pl = plan_of(B=1, T=1, H=8, prefix_max=32768)  # Kimi decode: one 16-row tile
    assert pl.mt == 1 and pl.row_tiles == 1 and 64 <= pl.splits <= 256
    assert pl.grid[1] * pl.grid[0] >= H200_SMS // 2


def test_many_row_tiles_need_few_splits():
    big = plan_of(B=1, T=513, H=16, prefix_max=131072)  # 129 row tiles: one wave already
    assert big.row_tiles == 129 and big.splits == 1
    mid = plan_of(B=1, T=65, H=16, prefix_max=8192)
    assert mid.row_tiles == 17 and 2 <= mid.splits <= 16


def test_no_prefix_no_split_but_the_merge_bug_forces_one():
    assert plan_of(B=2, T=17, H=16, prefix_max=0).splits == 1
    assert plan_of(B=2, T=17, H=16, prefix_max=0, bug=Bug.MERGE_WRONG_MAX).splits == 2


def test_workspace_holds_partial_out_lse_and_merge_counters():
    pl = plan_of(B=2, T=5, H=8, prefix_max=4096)
    assert pl.splits > 1 and pl.workspace_bytes(5, 8) == 2 * pl.splits * 40 * 513 * 4 + 2 * pl.row_tiles * 8
    assert plan_of(B=2, T=5, H=8, prefix_max=0).workspace_bytes(5, 8) == 0


def test_shape_of_a_problem_takes_what_its_buffers_hold_not_its_lengths():
    """The capacity is the block table's tokens less the tree, in whole 64-key tiles: the same plan whatever
    lengths the buffers hold (a graph captured at dummy lengths plans as the direct run does)."""
    from types import SimpleNamespace

    def problem(P, width, page=64):
        return SimpleNamespace(B=3, T=9, H=8, prefix_lens=np.array(P), page_size=page,
                               block_table=np.zeros((3, width), np.int32))

    shape = Shape.of(problem([5, 700, 64], 12))
    assert shape == Shape(3, 9, 8, 704) and shape.rows == 72  # 768 - 9 tokens, whole tiles: 704
    assert Shape.of(problem([0, 1, 1], 12)) == shape
    assert Shape.of(problem([8192], 129)).capacity == 8192  # a table as tight as a golden's for P = 8k, T = 9
    assert Shape.of(problem([0], 1, page=1)).capacity == 0


def test_in_kernel_merge_only_on_one_wave_grids_with_a_unit_per_split():
    """A merging CTA waits for its row tile's other splits: they must all be resident (one wave);
    and no split merges two (row, 128-column) units (Kimi T9 decode was slower that way)."""
    decode = plan_of(B=1, T=1, H=8, prefix_max=32768, mt=4, can_merge=True)
    assert decode.merge is Merge.IN_KERNEL and decode.row_tiles * decode.splits <= H200_SMS
    assert plan_of(B=1, T=1, H=8, prefix_max=32768, mt=4).merge is Merge.COMBINE  # the kernel cannot
    assert not plan_of(B=1, T=1, H=8, prefix_max=32768, mt=4, can_merge=True, splits=200).merge
    assert not plan_of(B=8, T=65, H=16, prefix_max=8192, mt=4, can_merge=True).merge  # waves
    few = plan_of(B=32, T=1, H=8, prefix_max=32768, mt=4, can_merge=True)
    assert few.splits < 32 and not few.merge  # 8 rows x 4 units need 32 splits
    t9 = plan_of(B=1, T=9, H=8, prefix_max=32768, mt=4, can_merge=True)
    assert t9.row_tiles * t9.splits <= H200_SMS and t9.splits < 64 * 4 and not t9.merge


def test_merge_combine_takes_the_combine_launch_even_where_the_kernel_could_merge():
    pl = plan_of(B=1, T=1, H=8, prefix_max=32768, mt=4, can_merge=True, merge=Merge.COMBINE)
    assert pl.merge is Merge.COMBINE and pl == plan_of(B=1, T=1, H=8, prefix_max=32768, mt=4)


def test_forced_in_kernel_merge_drops_the_layouts_that_cannot_merge_there():
    """merge=kernel: Kimi decode (8 rows) takes the 64-row build and merges in the kernel instead of the
    all-transposed build and a combine launch; T9's 72 rows two 64-row tiles instead of one with
    transposed rows; a grid of several waves still goes to the combine launch."""
    kw = dict(T=1, H=8, prefix_max=32768, mt=4, can_merge=True, extra_rows=8, transposed_ctas_per_sm=2)
    assert plan_of(B=1, **kw).xr is RowLayout.TRANSPOSED
    forced = plan_of(B=1, merge=Merge.IN_KERNEL, **kw)
    assert forced.xr is RowLayout.TILES and forced.merge is Merge.IN_KERNEL
    t9 = plan_of(B=32, T=9, H=8, prefix_max=32768, mt=4, can_merge=True, extra_rows=8)
    assert t9.xr is RowLayout.EXTRA  # the model's choice for 32 requests ...
    t9 = plan_of(B=32, T=9, H=8, prefix_max=32768, mt=4, can_merge=True, extra_rows=8, merge=Merge.IN_KERNEL)
    assert t9.xr is RowLayout.TILES and t9.row_tiles == 2 and t9.merge is Merge.COMBINE  # ... and several waves


def test_occupancy_counts_registers_and_shared_memory():
    assert occupancy(256, 255, 70000) == 1  # 64K registers: one 256-thread CTA at 255 registers
    assert occupancy(128, 160, 70000) == 3  # smem-bound: 3 x 71 KB in 228 KB
    assert occupancy(128, 64, 20000) == 8
    assert occupancy(128, 64, 20000, SM_120) == 4  # 100 KB an SM: 4 x 21 KB
    assert occupancy(512, 32, 0, SM_120) == 3 and occupancy(512, 32, 0) == 4  # 1536 threads an SM against 2048
    assert resident_ctas(128, 64, 101377, SM_120) == 0  # past sm_120's 99 KB a CTA: none
    assert occupancy(128, 64, 116736 - 1024) == 2 and occupancy(128, 64, 116736 - 1023) == 1  # 128-byte units


KB = 1024


@pytest.mark.parametrize("threads, registers, static, smem, ctas, padded", [
    (256, 128, 0, 90 * KB, 1, 232448),  # 90 KB: one CTA on sm_120, two on the H200 unpadded; padded to its 227 KB
    (128, 64, 0, 40 * KB, 2, 233472 // 2 - KB),  # 40 KB: two on sm_120, five on the H200; half its 228 KB each
    (256, 94, 4160, 0, 2, 233472 // 2 - KB - 4160),  # register-bound at two on both; the static part counted
    (512, 32, 0, 0, 3, 233472 // 3 - KB),  # thread-bound: 1536 on sm_120 against 2048
    (256, 255, 0, 68188, 1, 232448),  # register-bound at one CTA on both: still the largest request that holds one
])
def test_the_padded_request_holds_the_h200_to_sm_120s_residency(threads, registers, static, smem, ctas, padded):
    assert emulated_smem(threads, registers, static, smem, SM_90, SM_120) == (ctas, padded)
    assert resident_ctas(threads, registers, static + padded, SM_90) == ctas == occupancy(threads, registers, static + smem, SM_120)
    assert resident_ctas(threads, registers, static + padded + 128, SM_90) < ctas or padded + static == SM_90.smem_per_cta


def test_a_90_kb_build_pads_past_half_the_h200s_shared_memory():
    """One CTA an SM on sm_120 (2 x 91 KB > 100 KB); the H200 would hold two unpadded, so the pad passes 114 KB."""
    assert resident_ctas(256, 128, 90 * KB, SM_90) == 2
    ctas, padded = emulated_smem(256, 128, 0, 90 * KB, SM_90, SM_120)
    assert ctas == 1 and padded > 114 * KB


@pytest.mark.parametrize("real, emulated, smem, says", [
    (SM_90, SM_120, 100 * KB, "102400 bytes of shared memory a CTA (static and dynamic) pass sm_120's 101376"),
    (SM_120, SM_90, 40 * KB, "sm_120 holds 2 CTAs an SM of this build, fewer than sm_90's 5"),
    (ArchLimits("small-optin", 233472, 48 * KB), SM_120, 40 * KB, "the most small-optin gives a CTA, leave 4 CTAs"),
])
def test_what_cannot_be_emulated_says_why_in_one_line(real, emulated, smem, says):
    with pytest.raises(ValueError) as info:
        emulated_smem(128, 64, 0, smem, real, emulated)
    assert says in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_arch_limits_of_a_device_info():
    info = {"cc": "sm_90", "smem_per_sm": 233472, "smem_optin": 232448, "regs_per_sm": 65536, "threads_per_sm": 2048,
            "ctas_per_sm": 32}
    assert ArchLimits.of(info) == SM_90
    assert ArchLimits.of({"smem_per_sm": 102400, "regs_per_sm": 65536}).smem_per_cta == 101376  # what a fake gives


def test_forced_split_count_keeps_the_merge_bug_floor():
    """A forced split count (splits=N) replaces the chosen one; the planted merge bug still gets a merge."""
    assert plan_of(1, 1, 8, 32768, splits=33).splits == 33
    assert plan_of(1, 1, 8, 32768, bug=Bug.MERGE_WRONG_MAX, splits=1).splits == 2
    transposed = dict(mt=4, extra_rows=8, transposed_ctas_per_sm=2, splits=1)  # all rows transposed, forced
    assert plan_of(1, 1, 8, 32768, **transposed).splits == 1
    assert plan_of(1, 1, 8, 32768, bug=Bug.MERGE_WRONG_MAX, **transposed).splits == 2


@pytest.mark.parametrize("P, T, splits", [(32768, 1, 129), (8192, 65, 7), (3100, 41, 7), (700, 41, 7), (0, 9, 3), (100, 513, 4)])
def test_split_ranges_cover_the_prefix_and_give_the_tail_split_fewer_keys(P, T, splits):
    """Contiguous, in order, ending at P; no split walks more tiles than the even share of prefix
    tiles + tail tiles (the last split's tail included), unless the tail alone is longer."""
    from kdtr.kernels.flash.plan import split_ranges, tiles_per_split

    r = split_ranges(P, T, splits, BN)
    assert len(r) == splits and r[0][0] == 0 and r[-1][1] == P
    assert all(a[1] == b[0] for a, b in zip(r, r[1:])) and all(lo <= hi for lo, hi in r)
    share = -(-(-(-P // BN) + -(-T // BN)) // splits)
    assert tiles_per_split(P, T, splits, BN) == max(share, -(-T // BN))


def test_decode_split_count_counts_the_tail_tile():
    """Kimi T1 P32k: 1024 prefix tiles + 1 tail tile. 128 splits would leave the last one 9 tiles
    behind 8; the plan takes enough splits that none walks more than 8."""
    from kdtr.kernels.flash.plan import tiles_per_split

    pl = plan_of(B=1, T=1, H=8, prefix_max=32768, mt=4, can_merge=True)
    assert pl.splits <= H200_SMS and tiles_per_split(32768, 1, pl.splits, BN) == 8
    assert tiles_per_split(32768, 1, 128, BN) == 9


@pytest.mark.parametrize("rows, tile, extra, expect", [
    (72, 64, 8, (1, 8)),     # Kimi T9: one CTA, 8 transposed rows
    (65, 64, 8, (1, 8)),
    (136, 64, 8, (2, 8)),    # the last of two tiles takes the rest
    (73, 64, 8, (2, 0)),     # 9 past the tile: a CTA of their own
    (64, 64, 8, (1, 0)),     # a full tile: nothing extra
    (8, 64, 8, (1, 0)),      # a single short tile is already one CTA
    (1040, 64, 8, (17, 0)),  # DeepSeek T65: 16 past the tile
    (72, 64, 0, (2, 0)),     # the kernel cannot: two CTAs
])
def test_extra_rows_ride_in_the_last_row_tile(rows, tile, extra, expect):
    from kdtr.kernels.flash.plan import extra_row_tiles

    assert extra_row_tiles(rows, tile, extra) == expect


def test_transposed_rows_plan_one_cta_per_split_and_never_merge_in_kernel():
    t9 = plan_of(B=1, T=9, H=8, prefix_max=32768, mt=4, can_merge=True, extra_rows=8, xr=True)
    assert t9.row_tiles == 1 and t9.xr is RowLayout.EXTRA and not t9.merge and t9.splits > 64
    assert plan_of(B=1, T=9, H=8, prefix_max=32768, mt=4, can_merge=True, extra_rows=8, splits=300,
                   xr=True).merge is Merge.COMBINE
    b32 = plan_of(B=32, T=9, H=8, prefix_max=32768, mt=4, extra_rows=8)
    assert b32.grid[0] == 1 and b32.xr == 8 and b32.workspace_bytes(9, 8) == 32 * b32.splits * 72 * 513 * 4 + 32 * 8
    assert plan_of(B=32, T=9, H=8, prefix_max=32768, mt=4, extra_rows=8, xr=False).xr is RowLayout.TILES  # xr=0


@pytest.mark.parametrize("B, P, xr", [(1, 32768, 0), (1, 131072, 0), (32, 32768, 8), (32, 131072, 8)])
def test_transposed_rows_where_the_model_says_they_pay(B, P, xr):
    """Their tiles cost ~1.8x a 64-row tile and their CTAs more set-up (measured, plan.XR_TILE_COST):
    they pay when requests fill the GPU (Kimi T9 B32: 635 -> 552 us) and not on split decode (T9 B1:
    36.4 -> 46.4 us), where the two 64-row CTAs per split stay."""
    pl = plan_of(B=B, T=9, H=8, prefix_max=P, mt=4, can_merge=True, extra_rows=8)
    assert pl.xr == xr and pl.row_tiles == (1 if xr else 2)


@pytest.mark.parametrize("B, P", [(1, 32768), (1, 131072), (4, 32768), (32, 32768), (32, 131072), (8, 131072), (2, 700)])
def test_eight_rows_or_fewer_run_all_transposed(B, P):
    """Kimi decode (8 rows) takes the all-transposed build wherever it exists: one row tile, splits for two
    resident CTAs per SM (more splits than SMs on B1: one wave of both) and the combine launch (within its
    80-register bound the build cannot merge in-kernel), never more splits than twice the 64-row plan's.
    Without the build the 64-row plan stands; 9 rows and more never take it; xr=0 keeps the 64-row build."""
    kw = dict(T=1, H=8, prefix_max=P, mt=4, can_merge=True, extra_rows=8, transposed_ctas_per_sm=2)
    pl, base = plan_of(B=B, **kw), plan_of(B=B, **{**kw, "transposed_ctas_per_sm": 0})
    assert pl.xr is RowLayout.TRANSPOSED and base.xr is not RowLayout.TRANSPOSED
    assert pl.row_tiles == 1 and not pl.merge and pl.splits <= 2 * base.splits
    assert B > 1 or P < 65536 or H200_SMS < pl.splits <= 2 * H200_SMS  # two CTAs per SM: more splits than SMs
    assert plan_of(B=B, xr=True, **kw) == pl
    assert plan_of(B=B, xr=False, **kw) == base
    kw.update(T=9, H=1)
    assert plan_of(B=B, xr=True, **kw).xr is not RowLayout.TRANSPOSED  # 9 rows
