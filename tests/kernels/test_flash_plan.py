"""The flash kernel's launch plan (pure arithmetic, no GPU)."""

import pytest

from kdtr.kernels.bugs import Bug
from kdtr.kernels.flash.plan import occupancy, plan, row_tile_m

H200_SMS = 132
BN = 32  # flash-sm90's KV tile (the plan reads it from the compiled module)


@pytest.mark.parametrize("rows, mt", [(1, 1), (16, 1), (17, 2), (72, 2), (128, 2), (129, 4), (16 * 1025, 4)])
def test_row_tile_is_the_smallest_that_holds_the_rows(rows, mt):
    assert row_tile_m(rows) == mt


def test_one_long_request_fills_the_gpu_with_splits():
    pl = plan(B=1, T=1, H=8, prefix_max=32768, sm_count=H200_SMS, bn=BN)  # Kimi decode: one 16-row tile
    assert pl.mt == 1 and pl.row_tiles == 1 and 64 <= pl.splits <= 256
    assert pl.grid[1] * pl.grid[0] >= H200_SMS // 2


def test_many_row_tiles_need_few_splits():
    big = plan(B=1, T=513, H=16, prefix_max=131072, sm_count=H200_SMS, bn=BN)  # 129 row tiles: one wave already
    assert big.row_tiles == 129 and big.splits == 1
    mid = plan(B=1, T=65, H=16, prefix_max=8192, sm_count=H200_SMS, bn=BN)
    assert mid.row_tiles == 17 and 2 <= mid.splits <= 16


def test_no_prefix_no_split_but_the_merge_bug_forces_one():
    assert plan(B=2, T=17, H=16, prefix_max=0, sm_count=H200_SMS, bn=BN).splits == 1
    assert plan(B=2, T=17, H=16, prefix_max=0, sm_count=H200_SMS, bn=BN, bug=Bug.MERGE_WRONG_MAX).splits == 2


def test_workspace_holds_partial_out_lse_and_merge_counters():
    pl = plan(B=2, T=5, H=8, prefix_max=4096, sm_count=H200_SMS, bn=BN)
    assert pl.splits > 1 and pl.workspace_bytes(5, 8) == 2 * pl.splits * 40 * 513 * 4 + 2 * pl.row_tiles * 8
    assert plan(B=2, T=5, H=8, prefix_max=0, sm_count=H200_SMS, bn=BN).workspace_bytes(5, 8) == 0


def test_in_kernel_merge_only_on_one_wave_grids_with_a_unit_per_split():
    """A merging CTA waits for its row tile's other splits: they must all be resident (one wave);
    and no split merges two (row, 128-column) units (Kimi T9 decode was slower that way)."""
    decode = plan(B=1, T=1, H=8, prefix_max=32768, sm_count=H200_SMS, bn=BN, mt=4, can_merge=True)
    assert decode.merge and decode.row_tiles * decode.splits <= H200_SMS
    assert not plan(B=1, T=1, H=8, prefix_max=32768, sm_count=H200_SMS, bn=BN, mt=4).merge  # kernel cannot
    assert not plan(B=1, T=1, H=8, prefix_max=32768, sm_count=H200_SMS, bn=BN, mt=4, can_merge=True, splits=200).merge
    assert not plan(B=8, T=65, H=16, prefix_max=8192, sm_count=H200_SMS, bn=BN, mt=4, can_merge=True).merge  # waves
    few = plan(B=32, T=1, H=8, prefix_max=32768, sm_count=H200_SMS, bn=BN, mt=4, can_merge=True)
    assert few.splits < 32 and not few.merge  # 8 rows x 4 units need 32 splits
    t9 = plan(B=1, T=9, H=8, prefix_max=32768, sm_count=H200_SMS, bn=BN, mt=4, can_merge=True)
    assert t9.row_tiles * t9.splits <= H200_SMS and t9.splits < 64 * 4 and not t9.merge


def test_occupancy_counts_registers_and_shared_memory():
    assert occupancy(256, 255, 70000) == 1  # 64K registers: one 256-thread CTA at 255 registers
    assert occupancy(128, 160, 70000) == 3  # smem-bound: 3 x 71 KB in 228 KB
    assert occupancy(128, 64, 20000) == 8


def test_more_merge_units_per_split_only_when_asked():
    """KDTR_FLASH_MERGE=N lets a merging split take N units (T9 decode: 256 units over its splits)."""
    t9 = dict(B=1, T=9, H=8, prefix_max=32768, sm_count=H200_SMS, bn=BN, mt=4, can_merge=True)
    assert not plan(**t9).merge and plan(**t9, merge_units=4).merge


def test_combine_chunks_spread_decode_merges_only():
    """Few rows (decode) get 4 combine CTAs per row; thousands of rows keep one (fixed cost per CTA)."""
    from kdtr.kernels.flash.plan import combine_chunks

    assert combine_chunks(8, 132, 4) == 4 and combine_chunks(72, 132, 4) == 4
    assert combine_chunks(1040, 132, 4) == 1 and combine_chunks(264, 132, 4) == 1


def test_forced_split_count_keeps_the_merge_bug_floor():
    """A forced split count (KDTR_FLASH_SPLITS) replaces the chosen one; the planted merge bug still gets a merge."""
    from kdtr.kernels.bugs import Bug
    from kdtr.kernels.flash.plan import plan

    assert plan(1, 1, 8, 32768, 132, BN, splits=33).splits == 33
    assert plan(1, 1, 8, 32768, 132, BN, bug=Bug.MERGE_WRONG_MAX, splits=1).splits == 2
    tail = dict(extra_rows=8, x_only_ctas_per_sm=2, tail="1", splits=1)  # the tail launch's row tiles, forced
    assert plan(1, 9, 8, 32768, 132, BN, **tail).splits == 1
    assert plan(1, 9, 8, 32768, 132, BN, bug=Bug.MERGE_WRONG_MAX, **tail).splits == 2


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

    pl = plan(B=1, T=1, H=8, prefix_max=32768, sm_count=H200_SMS, bn=BN, mt=4, can_merge=True)
    assert pl.splits <= H200_SMS and tiles_per_split(32768, 1, pl.splits, BN) == 8
    assert tiles_per_split(32768, 1, 128, BN) == 9


def test_combine_launch_takes_a_warp_per_row_where_rows_fill_the_gpu():
    """Compute shapes (1040+ rows, splits that fit a lane each) merge a warp per row; decode launches
    of few rows the narrow merge (32-column chunks for one 8-row request, 64 on more; 4 warps where they
    take every split in one step) where its grid is one wave of that build; more rows the row-per-CTA merge
    with column chunks, and so does any split count above the rows kernel's limit; KDTR_FLASH_COMBINE's
    values force each where it can run."""
    from kdtr.kernels.flash.plan import COMBINE, COMBINE_NARROW, COMBINE_ROWS, combine_launch

    narrow = lambda cols, warps: COMBINE_NARROW.format(out="{out}", cols=cols, warps=warps)  # noqa: E731
    rows = lambda parts: COMBINE_ROWS.format(out="{out}", parts=parts)  # noqa: E731
    cfg = {"COMBINE_MAX_CHUNKS": 4, "COMBINE_ROWS_MAX_SPLITS": 32, "COMBINE_THREADS": 256, "NARROW_BATCH": 9,
           "COMBINE_ROWS_BATCH": 4}
    asked = []

    def per_sm(name, threads):  # 80 registers a thread: 3 CTAs of 8 warps an SM, 6 of 4 (the H200 builds)
        asked.append((name, threads))
        return 65536 // (80 * threads)

    def launch(*args, force=""):
        return combine_launch(*args[:3], H200_SMS, cfg, per_sm, force)

    assert launch(1040, 1, 7) == (rows(2), (130, 1, 2), 256)  # 7 splits: half rows, one step of 8
    assert launch(1040, 1, 4) == (rows(1), (130, 1, 1), 256)  # 4 splits: whole rows, one step of 4
    assert launch(4112, 8, 2) == (rows(1), (514, 8, 1), 256)
    assert launch(1040, 1, 33) == (COMBINE, (1040, 1, 1), 256)  # splits past a warp; rows fill the GPU
    assert not asked  # rows that cover the GPU twice: no narrow build is loaded to find that out
    assert launch(8, 32, 10) == (COMBINE, (8, 32, 4), 256)  # 256 rows: 2048 CTAs of 4 warps, 2.6 waves
    assert launch(8, 1, 241) == (narrow(32, 8), (8, 1, 16), 256)  # Kimi T1 B1: 128 CTAs, 288 splits a step
    assert launch(8, 2, 241) == (narrow(64, 8), (8, 2, 8), 256)  # T1 B2: 32 columns would be 256 CTAs
    assert launch(40, 1, 129) == (narrow(64, 8), (40, 1, 8), 256)  # T5 B1: 320 CTAs, one wave of 396
    assert launch(72, 1, 66) == (narrow(64, 4), (72, 1, 8), 128)  # T9 B1: 72 splits a step; 576 of 792
    assert launch(8, 8, 33) == (narrow(64, 4), (8, 8, 8), 128)  # T1 B8: 512 CTAs, one wave at 4 warps
    assert launch(40, 2, 129) == (COMBINE, (40, 2, 4), 256)  # 80 rows at 8 warps: 640 CTAs, two waves
    assert launch(72, 2, 66) == (COMBINE, (72, 2, 4), 256)  # 144 rows: 1152 CTAs
    assert ("kdtr_flash_combine_narrow<{out}, 64, 4>", 128) in asked and ("kdtr_flash_combine_narrow<{out}, 64, 8>", 256) in asked
    assert launch(72, 1, 66, force="narrow32") == (narrow(32, 4), (72, 1, 16), 128)
    assert launch(8, 1, 241, force="narrow64") == (narrow(64, 8), (8, 1, 8), 256)
    assert launch(1040, 1, 7, force="narrow") == (narrow(64, 4), (1040, 1, 8), 128)  # forced: any number of waves
    assert launch(72, 1, 7, force="rows") == (rows(2), (9, 1, 2), 256)
    assert launch(1040, 1, 7, force="split") == (COMBINE, (1040, 1, 1), 256)
    assert launch(72, 1, 40, force="rows") == (COMBINE, (72, 1, 4), 256)


def test_rows_merge_halves_a_row_where_whole_rows_take_two_steps():
    """A warp merges a whole row while its 4 partial rows in flight take every split, else half a row with 8."""
    from kdtr.kernels.flash.plan import rows_parts

    assert [rows_parts(s, 4) for s in (1, 4, 5, 8, 32)] == [1, 1, 2, 2, 2]


def test_narrow_warps_take_every_split_in_one_step_where_they_can():
    """4 warps while their loads cover the splits in one step (64 columns: 16 lanes a row, 2 rows a warp,
    9 loads a lane: 72 splits; 32 columns: 144), else 8 (144 / 288), and 8 past that too (more steps)."""
    from kdtr.kernels.flash.plan import narrow_warps

    assert [narrow_warps(s, 64, 9) for s in (1, 72, 73, 144, 145, 600)] == [4, 4, 8, 8, 8, 8]
    assert [narrow_warps(s, 32, 9) for s in (144, 145, 288, 289)] == [4, 8, 8, 8]


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
    t9 = plan(B=1, T=9, H=8, prefix_max=32768, sm_count=H200_SMS, bn=BN, mt=4, can_merge=True, extra_rows=8,
              xr_always=True)
    assert t9.row_tiles == 1 and t9.xr == 8 and not t9.merge and t9.splits > 64
    assert plan(B=1, T=9, H=8, prefix_max=32768, sm_count=H200_SMS, bn=BN, mt=4, can_merge=True, extra_rows=8,
                splits=300, xr_always=True).merge is False
    b32 = plan(B=32, T=9, H=8, prefix_max=32768, sm_count=H200_SMS, bn=BN, mt=4, extra_rows=8)
    assert b32.grid[0] == 1 and b32.xr == 8 and b32.workspace_bytes(9, 8) == 32 * b32.splits * 72 * 513 * 4 + 32 * 8


@pytest.mark.parametrize("B, P, xr", [(1, 32768, 0), (1, 131072, 0), (32, 32768, 8), (32, 131072, 8)])
def test_transposed_rows_where_the_model_says_they_pay(B, P, xr):
    """Their tiles cost ~1.8x a 64-row tile and their CTAs more set-up (measured, kdtr.flash_plan.XR_TILE_COST):
    they pay when requests fill the GPU (Kimi T9 B32: 635 -> 552 us) and not on split decode (T9 B1:
    36.4 -> 46.4 us), where the two 64-row CTAs per split stay."""
    pl = plan(B=B, T=9, H=8, prefix_max=P, sm_count=H200_SMS, bn=BN, mt=4, can_merge=True, extra_rows=8)
    assert pl.xr == xr and pl.row_tiles == (1 if xr else 2)


@pytest.mark.parametrize("B, P", [(1, 32768), (1, 131072), (4, 32768), (32, 32768), (32, 131072), (8, 131072), (2, 700)])
def test_eight_rows_or_fewer_run_all_transposed(B, P):
    """Kimi decode (8 rows) takes XR_ONLY wherever the build exists (docs/PERF.md, sessions 13 and 15):
    one row tile, splits for two resident CTAs per SM (more splits than SMs on B1: one wave of both) and
    the combine launch (within its 80-register bound the build cannot merge in-kernel), never more
    splits than twice the 64-row plan's. Without the build the 64-row plan stands; 9 rows and more
    never take it."""
    from kdtr.kernels.flash.plan import XR_ONLY

    kw = dict(T=1, H=8, prefix_max=P, sm_count=H200_SMS, bn=BN, mt=4, can_merge=True, extra_rows=8, x_only_ctas_per_sm=2)
    pl, base = plan(B=B, **kw), plan(B=B, **{**kw, "x_only_ctas_per_sm": 0})
    assert pl.xr == XR_ONLY and base.xr != XR_ONLY
    assert pl.row_tiles == 1 and not pl.merge and pl.splits <= 2 * base.splits
    assert B > 1 or P < 65536 or H200_SMS < pl.splits <= 2 * H200_SMS  # two CTAs per SM: more splits than SMs
    assert plan(B=B, xr_always=True, **kw) == pl
    kw.update(T=9, H=1)
    assert plan(B=B, xr_always=True, **kw).xr != XR_ONLY  # 9 rows


def test_rows_past_64k_run_as_a_tail_launch_only_where_forced():
    """KDTR_FLASH_TAIL=1 (kdtr.flash_plan.plan's ``tail``): instead of a second 64-row CTA per split for the 8
    rows of Kimi T9, they run as an XR_ONLY launch beside the 64-row one (two tail CTAs per SM), and
    the 64-row tile gets the splits their half-SMs leave room for: 88 + 88 / 2 = 132 SMs. Measured
    slower (docs/PERF.md, session 13), so never by default."""
    kw = dict(T=9, H=8, sm_count=H200_SMS, bn=BN, mt=4, can_merge=True, extra_rows=8, x_only_ctas_per_sm=2)
    t9 = plan(B=1, prefix_max=32768, tail="1", **kw)
    assert t9.tail and t9.grid == (1, 88, 1) and not t9.merge and not t9.xr
    assert t9.workspace_bytes(9, 8) == 88 * 72 * 513 * 4 + 8
    for tail in ("", "0"):
        assert plan(B=1, prefix_max=32768, tail=tail, **kw) == plan(B=1, prefix_max=32768, **{**kw, "x_only_ctas_per_sm": 0})
    assert not plan(B=1, prefix_max=32768, tail="1", **{**kw, "x_only_ctas_per_sm": 0}).tail  # no XR_ONLY build
    assert plan(B=32, prefix_max=32768, tail="1", **kw).tail
    t17 = plan(B=1, T=17, H=8, prefix_max=32768, sm_count=H200_SMS, bn=BN, mt=4, can_merge=True, extra_rows=8,
               x_only_ctas_per_sm=2, tail="1")
    assert t17.tail and t17.row_tiles == 2 and t17.splits == 52  # 2 x 52 + 52 / 2 = 130 SMs
    kw.update(T=10)  # 80 rows: 16 past 64
    assert not plan(B=1, prefix_max=32768, tail="1", **kw).tail


def sm90_steps_on_a_faked_h200(monkeypatch, B: int, T: int, H: int, P: int, env: dict):
    """FlashKernel.steps of flash-sm90 with the launch layer faked (no GPU): an H200's properties, loaded
    kernels whose registers are ptxas's for their build (XR_ONLY 56, the merges 80, the rest 168), the config array as
    the kernel exports it. Returns [(name expression, grid, dependent)] of the launches."""
    import types

    import numpy as np

    from kdtr.kernels import launch
    from kdtr.kernels.registry import resolve_kernel

    for key in ("KDTR_FLASH_XR", "KDTR_FLASH_TAIL", "KDTR_FLASH_SPLITS", "KDTR_FLASH_MERGE", "KDTR_FLASH_SEGMENTS",
                "KDTR_TMA_PROMOTION"):
        monkeypatch.setenv(key, env.get(key, ""))
    monkeypatch.setattr(launch, "device_info", lambda: {"sm_count": H200_SMS, "regs_per_sm": 65536, "cc": "sm_90",
                                                        "smem_per_sm": 233472, "l2_bytes": 60 << 20})
    monkeypatch.setattr(launch, "device_ints", lambda a: a)

    def load(source, expr, arch=None, options=(), dependent=False):
        regs = 80 if expr.startswith("kdtr_flash_combine") else 56 if expr.endswith(", 1>") else 168
        compiled = types.SimpleNamespace(resources={"k": types.SimpleNamespace(registers=regs, shared_bytes=0)},
                                         lowered={expr: "k"})
        return launch.Loaded(None, None, compiled, launch.DEFAULT_LAUNCH, dependent)

    monkeypatch.setattr(launch, "load_function", load)
    k = resolve_kernel("flash-sm90")
    k._config = dict(BN=32, STAGES=2, MAX_T=1280, SMEM_MT4=101280, THREADS_MT4=384, COMBINE_THREADS=256,
                     COMBINE_MAX_CHUNKS=4, TMA_BOX_COLS=64, TMA_BOX_SLABS=9, COMBINE_ROWS_MAX_SPLITS=32, WORK_INTS=6,
                     JOB_INTS=4, NARROW_BATCH=9, COMBINE_ROWS_BATCH=4)
    from kdtr.kernels.flash import tma

    # the driver encodes it on a GPU: the fake returns what it was asked for
    monkeypatch.setattr(tma, "encode", lambda spec, ptr, promotion=tma.L2_PROMOTION: (spec, promotion))
    pages = B * -(-P // 64)
    prob = types.SimpleNamespace(B=B, T=T, H=H, prefix_lens=np.full(B, P, np.int64), page_size=64,
                                 kv_cache=np.empty((pages, 64, 1), np.uint8))  # [pages, page_size, ...]: shape only
    kv = types.SimpleNamespace(data=types.SimpleNamespace(ptr=0))
    steps, _, _ = k.steps(types.SimpleNamespace(problem=prob, out_dtype="bf16", kv_cache=kv))
    for s in steps[:1]:  # the main kernel takes the cache's tensor map: one box is one 32-key tile
        forced = env.get("KDTR_TMA_PROMOTION")
        assert s[4][0] == (tma.kv_map_spec(pages, 64, 576, 64, 32, 9),
                           tma.L2_PROMOTIONS[forced] if forced else tma.L2_PROMOTION_128B)
    return [(*s[0].compiled.lowered, tuple(s[1]), s[0].dependent) for s in steps]


def test_the_planned_launches_take_each_build_where_the_plan_says(monkeypatch):
    """From the plan to the launches (faked launch layer): Kimi decode B1 takes XR_ONLY and the narrow
    combine launch (32-column chunks, 8 warps; T9 B1's 72 rows 64 columns, 4 warps) (KDTR_FLASH_XR=0: the 64-row
    build, merging in-kernel); B32 P128k takes XR_ONLY with the
    128-column combine; T9 B1 two 64-row tiles; the tail launch, forced, follows the 64-row launch
    dependent on it, then the combine."""
    run = lambda *a, **env: sm90_steps_on_a_faked_h200(monkeypatch, *a, env)  # noqa: E731
    main, combine = run(1, 1, 8, 131072)
    assert main[:2] == ("kdtr_flash90_verify<__nv_bfloat16, 0, 0, 1>", (1, 241, 1))
    assert run(1, 1, 8, 131072, KDTR_TMA_PROMOTION="256")[0] == main  # the map's promotion checked inside
    assert combine[:2] == ("kdtr_flash_combine_narrow<__nv_bfloat16, 32, 8>", (8, 1, 16)) and combine[2]
    (one,) = run(1, 1, 8, 131072, KDTR_FLASH_XR="0")
    assert one[0] == "kdtr_flash90_verify<__nv_bfloat16, 0, 1, 0>" and one[1][0] == 1
    main, combine = run(32, 1, 8, 131072)
    assert main[0] == "kdtr_flash90_verify<__nv_bfloat16, 0, 0, 1>" and main[1] == (1, 33, 32)
    assert combine[0].startswith("kdtr_flash_combine<") and combine[2]
    assert run(32, 1, 8, 131072, KDTR_FLASH_XR="0")[0][0].endswith(", 0, 0>")
    t9 = run(1, 9, 8, 32768)
    assert t9[0][0].endswith(", 0, 0>") and t9[0][1][0] == 2 and len(t9) == 2
    assert t9[1][:2] == ("kdtr_flash_combine_narrow<__nv_bfloat16, 64, 4>", (72, 1, 8))  # 72 rows: 64 columns, 4 warps
    main, tail, combine = run(1, 9, 8, 32768, KDTR_FLASH_TAIL="1")
    assert main[:2] == ("kdtr_flash90_verify<__nv_bfloat16, 0, 0, 0>", (1, 88, 1)) and not main[2]
    assert tail == ("kdtr_flash90_verify<__nv_bfloat16, 0, 0, 1>", (1, 88, 1), True) and combine[2]
