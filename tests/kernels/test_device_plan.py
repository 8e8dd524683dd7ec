"""The device half of the flash plan (kdtr/kernels/flash/device_plan.py) against cuda/flash_sched.cuh: the struct,
the scheduler's constants and its recipe families, read from the header so the two cannot drift apart. No GPU."""

import re

import numpy as np
import pytest

from kdtr.kernels import contract
from kdtr.kernels.flash import device_plan, plan, schedule
from kdtr.kernels.nvrtc import CUDA_DIR

TEXT = (CUDA_DIR / device_plan.HEADER_NAME).read_text()


def constants() -> dict[str, int]:
    """``constexpr int NAME = <int>;`` of the header (expressions skipped)."""
    return {k: int(v) for k, v in re.findall(r"constexpr int (\w+) = (\d+);", TEXT)}


def test_flash_sched_fields_and_layout_match_the_header():
    fields = contract.parse_header_struct(TEXT, "FlashSched")
    assert tuple(fields) == device_plan.FIELDS
    offsets, size = contract.c_layout(fields)
    assert [device_plan.DTYPE.fields[n][1] for n, _ in fields] == offsets and device_plan.DTYPE.itemsize == size


def test_scheduler_limits_and_table_layout_match_the_header():
    c = constants()
    assert c["SCHED_HEADER"] == device_plan.SCHED_HEADER and c["SCHED_SCRATCH"] == device_plan.SCHED_SCRATCH
    assert c["SCHED_THREADS"] == device_plan.SCHED_THREADS
    assert c["SCHED_MAX_PIECES"] == plan.MAX_TABLE_PIECES and c["SCHED_MAX_JOBS"] == plan.MAX_TABLE_JOBS
    assert c["SCHED_MAX_SPLITS"] == schedule.MAX_PIECES == plan.SPLIT_MAX
    assert (c["WORK_INTS"], c["JOB_INTS"]) == (len(schedule.WORK_FIELDS), len(schedule.JOB_FIELDS))
    smem = re.search(r"SCHED_SMEM_BYTES = SCHED_MAX_PIECES \* 8 \+ (\d+) \* SCHED_MAX_JOBS \* 4 \+ "
                     r"\(SCHED_THREADS / 32 \+ 1\) \* 4;", TEXT)
    arrays = int(smem.group(1))
    assert device_plan.SCHED_SMEM_BYTES == c["SCHED_MAX_PIECES"] * 8 + arrays * c["SCHED_MAX_JOBS"] * 4 + (
        c["SCHED_THREADS"] // 32 + 1) * 4
    assert device_plan.SCHED_SMEM_BYTES <= 227 * 1024  # one CTA on sm_90a


def test_recipe_families_match_the_headers_enum():
    assert contract.parse_header_enum(TEXT, "SchedFamily") == {
        f"SCHED_{f.name}": int(f) for f in schedule.Family}


def test_pack_writes_every_field_and_refuses_what_does_not_fit():
    rec = device_plan.pack(splits=0x1000, table_offset=-1, tiles_cap=3, tile_shift=5, max_pieces=7, max_jobs=2,
                           family=2, target=132, interval=0, whole=0, row_tiles=17, rows_per_tile=64)
    assert rec.dtype == device_plan.DTYPE and rec.shape == (1,)
    assert (int(rec[0]["splits"]), int(rec[0]["table_offset"]), int(rec[0]["row_tiles"])) == (0x1000, -1, 17)
    with pytest.raises(TypeError):
        device_plan.pack(splits=0)
    with pytest.raises(ValueError):
        device_plan.pack(splits=-5, table_offset=0, tiles_cap=0, tile_shift=0, max_pieces=0, max_jobs=0, family=0,
                         target=0, interval=0, whole=0, row_tiles=0, rows_per_tile=0)


def test_tile_shift_is_the_log_of_a_power_of_two_tile():
    assert device_plan.tile_shift(16) == 4 and device_plan.tile_shift(32) == 5
    with pytest.raises(ValueError):
        device_plan.tile_shift(48)


def test_the_split_table_is_the_cost_model_at_every_length_and_the_capacity_caps_it():
    """Entry n of the table is choose_splits of a request of n tiles, between at_least and the grid's count."""
    model = plan.SplitModel(T=1, bn=32, base_ctas=1, rows=8, B=1, slots=264, most=205)
    table = model.table(32768)
    assert table.dtype == np.int32 and table.shape == (32768 // 32 + 1,)
    assert table[-1] == 205 and table.max() <= 205 and table[:3].tolist() == [1, 1, 1]
    for n in (10, 100, 700):
        assert table[n] == min(205, plan.choose_splits(n * 32, 1, 32, 1, 8, 1, 264))
    bug = plan.SplitModel(T=9, bn=32, base_ctas=2, rows=72, B=1, slots=132, most=66, at_least=2)
    assert bug.table(64).min() == 2
    forced = plan.SplitModel(T=9, bn=32, base_ctas=2, rows=72, B=1, slots=132, most=7, forced=4)
    assert set(forced.table(4096).tolist()) == {4}
