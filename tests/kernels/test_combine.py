"""The split merge launch (kdtr/kernels/flash/combine.py): pure arithmetic, no GPU."""

from kdtr.kernels.flash.combine import COMBINES, NARROW_COLS

H200_SMS = 132


def test_the_forceable_merges_are_the_narrow_widths_and_the_kernels():
    assert COMBINES == ("rows", "split", "narrow", *(f"narrow{c}" for c in NARROW_COLS))


def test_combine_chunks_spread_decode_merges_only():
    """Few rows (decode) get 4 combine CTAs per row; thousands of rows keep one (fixed cost per CTA)."""
    from kdtr.kernels.flash.combine import combine_chunks

    assert combine_chunks(8, 132, 4) == 4 and combine_chunks(72, 132, 4) == 4
    assert combine_chunks(1040, 132, 4) == 1 and combine_chunks(264, 132, 4) == 1


def test_combine_launch_takes_a_warp_per_row_where_rows_fill_the_gpu():
    """Compute shapes (1040+ rows, splits that fit a lane each) merge a warp per row; decode launches
    of few rows the narrow merge (32-column chunks for one 8-row request, 64 on more; 4 warps where they
    take every split in one step) where its grid is one wave of that build; more rows the row-per-CTA merge
    with column chunks, and so does any split count above the rows kernel's limit; a Force's
    combine=VALUE forces each where it can run."""
    from kdtr.kernels.flash.combine import COMBINE, COMBINE_NARROW, COMBINE_ROWS, combine_launch

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
    from kdtr.kernels.flash.combine import rows_parts

    assert [rows_parts(s, 4) for s in (1, 4, 5, 8, 32)] == [1, 1, 2, 2, 2]


def test_narrow_warps_take_every_split_in_one_step_where_they_can():
    """4 warps while their loads cover the splits in one step (64 columns: 16 lanes a row, 2 rows a warp,
    9 loads a lane: 72 splits; 32 columns: 144), else 8 (144 / 288), and 8 past that too (more steps)."""
    from kdtr.kernels.flash.combine import narrow_warps

    assert [narrow_warps(s, 64, 9) for s in (1, 72, 73, 144, 145, 600)] == [4, 4, 8, 8, 8, 8]
    assert [narrow_warps(s, 32, 9) for s in (144, 145, 288, 289)] == [4, 8, 8, 8]
