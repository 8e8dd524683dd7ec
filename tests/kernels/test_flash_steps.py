"""From a kernel spec to the launches it makes, without a GPU: FlashKernel.steps on a faked launch layer
(an H200's properties, loaded kernels with ptxas's registers for their build), for the plan's own
choices and for each branch a Force suffix selects."""

from __future__ import annotations

import types

import numpy as np
import pytest

from kdtr.kernels import launch
from kdtr.kernels.flash import tma
from kdtr.kernels.launch_types import Step
from kdtr.kernels.registry import resolve_kernel

H200_SMS = 132
CONFIGS = {
    "flash-sm90": dict(BN_MT4=32, STAGES=4, MAX_T=1280, SMEM_MT4=184888, THREADS_MT4=384, COMBINE_THREADS=256,
                       COMBINE_MAX_CHUNKS=4, TMA_BOX_COLS=64, TMA_BOX_SLABS=9, COMBINE_ROWS_MAX_SPLITS=32, WORK_INTS=6,
                       JOB_INTS=4, NARROW_BATCH=9, COMBINE_ROWS_BATCH=4, SMEM_TRANSPOSED=101320),
    "flash": dict(BN_MT1=16, BN_MT2=16, BN_MT4=32, STAGES=2, MAX_T=1280, SMEM_MT1=42700, SMEM_MT2=43600, SMEM_MT4=97976, THREADS_MT1=128,
                  THREADS_MT2=128, THREADS_MT4=256, COMBINE_THREADS=256, COMBINE_MAX_CHUNKS=4,
                  COMBINE_ROWS_MAX_SPLITS=32, NARROW_BATCH=9, COMBINE_ROWS_BATCH=4),
}
"""The config arrays as the kernels export them (tests/kernels/test_build_report.py reads the real ones)."""


@pytest.fixture
def faked(monkeypatch):
    """spec, (B, T, H, P) -> [(name expression, grid, dependent)] of its launches (+ the steps themselves)."""
    monkeypatch.setattr(launch, "device_info", lambda: {"sm_count": H200_SMS, "regs_per_sm": 65536, "cc": "sm_90",
                                                        "smem_per_sm": 233472, "l2_bytes": 60 << 20})
    monkeypatch.setattr(launch, "device_ints", lambda a: types.SimpleNamespace(host=a, size=a.size,
                                                                             data=types.SimpleNamespace(ptr=4096)))

    def load(source, expr, arch=None, options=(), dependent=False):  # ptxas's registers (NVRTC 13.5, sm_90), about
        # all rows transposed 56, the merges 80, flash's 32- and 64-row tiles 254, the rest 168
        regs = (80 if expr.startswith("kdtr_flash_combine") else 56 if expr.endswith(", 0, 1>")
                else 254 if expr.startswith(("kdtr_flash_verify<2,", "kdtr_flash_verify<4,")) else 168)
        compiled = types.SimpleNamespace(resources={"k": types.SimpleNamespace(registers=regs, shared_bytes=0)},
                                         lowered={expr: "k"})
        return launch.Loaded(None, None, compiled, launch.DEFAULT_LAUNCH, dependent)

    monkeypatch.setattr(launch, "load_function", load)
    monkeypatch.setattr(tma, "encode", lambda spec, ptr: spec)  # the driver encodes it on a GPU

    def run(spec: str, B: int, T: int, H: int, P: int, full: bool = False):
        k = resolve_kernel(spec)
        k._config = CONFIGS[k.variant.label]
        width = -(-(P + T) // 64)  # a block table as tight as a golden's: the plan's capacity is P (P % 64 == 0)
        pages = B * width + 1
        prob = types.SimpleNamespace(B=B, T=T, H=H, prefix_lens=np.full(B, P, np.int64), page_size=64,
                                     kv_cache=np.empty((pages, 64, 1), np.uint8),  # [pages, page_size, ...]: shape only
                                     block_table=np.zeros((B, width), np.int32))
        kv = types.SimpleNamespace(data=types.SimpleNamespace(ptr=0))
        steps, ws, splits = k.steps(types.SimpleNamespace(problem=prob, out_dtype="bf16", kv_cache=kv))
        assert all(isinstance(s, Step) for s in steps)
        main = next(s for s in steps if "_verify<" in next(iter(s.loaded.compiled.lowered)))
        if k.variant.kv_tensor_map:  # the main kernel takes the cache's tensor map: one box is one 32-key tile
            assert main.args[0] == tma.kv_map_spec(pages, 64, 576, 64, 32, 9)
        made = [(*s.loaded.compiled.lowered, tuple(s.grid), s.loaded.dependent) for s in steps]
        return (made, steps, ws, splits) if full else made

    return run


def test_the_plans_own_choices(faked):
    """Kimi decode B1 takes the all-transposed build and the narrow combine launch (32-column chunks, 8
    warps), dependent on it; B32 P128k the 128-column combine; T9 B1 two 64-row tiles and the narrow merge
    at 64 columns, 4 warps."""
    main, combine = faked("flash-sm90", 1, 1, 8, 131072)
    assert main == ("kdtr_flash_sm90_verify<__nv_bfloat16, 0, 0, 1>", (1, 241, 1), False)
    assert combine == ("kdtr_flash_combine_narrow<__nv_bfloat16, 32, 8>", (8, 1, 16), True)
    main, combine = faked("flash-sm90", 32, 1, 8, 131072)
    assert main[:2] == ("kdtr_flash_sm90_verify<__nv_bfloat16, 0, 0, 1>", (1, 33, 32))
    assert combine[0].startswith("kdtr_flash_combine<") and combine[2]
    t9 = faked("flash-sm90", 1, 9, 8, 32768)
    assert t9[0][0].endswith(", 0, 0>") and t9[0][1][0] == 2 and len(t9) == 2
    assert t9[1][:2] == ("kdtr_flash_combine_narrow<__nv_bfloat16, 64, 4>", (72, 1, 8))


@pytest.mark.parametrize("B, T, H, mt", [(1, 65, 16, 2), (8, 65, 16, 2), (1, 257, 16, 4), (8, 257, 16, 4), (32, 5, 8, 4),
                                         (32, 9, 8, 2)])
def test_flash_weighs_its_row_tiles_past_32_rows(faked, B, T, H, mt):
    """DeepSeek T65 (1040 rows) runs on 32-row tiles, T257 on 64-row ones, Kimi T5 B32 (40 rows) on one 64-row tile, T9
    (72 rows) on three 32-row ones (plan.choose_row_tile at the faked builds' residency); the launch is that tile's:
    its threads and its CTAs along x."""
    (main, *_), steps, _, _ = faked("flash", B, T, H, 32768, full=True)
    assert main[0] == f"kdtr_flash_verify<{mt}, __nv_bfloat16, 0>"
    assert main[1][0] == -(-T * H // (16 * mt)) and steps[0].block == (CONFIGS["flash"][f"THREADS_MT{mt}"], 1, 1)


def test_xr_0_keeps_the_64_row_build_which_merges_in_the_kernel(faked):
    (one,) = faked("flash-sm90[xr=0]", 1, 1, 8, 131072)
    assert one[0] == "kdtr_flash_sm90_verify<__nv_bfloat16, 0, 1, 0>" and one[1][0] == 1
    assert faked("flash-sm90[xr=0]", 32, 1, 8, 131072)[0][0].endswith(", 0, 0>")


def test_merge_kernel_and_merge_combine(faked):
    """merge=kernel: decode merges in the kernel (no all-transposed build); merge=combine: the 64-row
    decode plan that would merge in the kernel takes the combine launch."""
    (one,) = faked("flash-sm90[merge=kernel]", 1, 1, 8, 131072)
    assert one[0] == "kdtr_flash_sm90_verify<__nv_bfloat16, 0, 1, 0>"
    main, combine = faked("flash-sm90[xr=0,merge=combine]", 1, 1, 8, 131072)
    assert main[0] == "kdtr_flash_sm90_verify<__nv_bfloat16, 0, 0, 0>" and combine[0].startswith("kdtr_flash_combine")


def test_xr_1_takes_transposed_rows_wherever_they_apply(faked):
    (main, combine) = faked("flash-sm90[xr=1]", 1, 9, 8, 32768)  # the model keeps two 64-row tiles here
    assert main[0] == "kdtr_flash_sm90_verify<__nv_bfloat16, 0, 0, 8>" and main[1][0] == 1


def test_forced_splits_and_combine_kernel(faked):
    made, steps, ws, splits = faked("flash-sm90[splits=7,merge=combine,combine=rows]", 1, 65, 16, 1500, full=True)
    assert splits == 7 and made[0][1][1] == 7
    assert made[1][0] == "kdtr_flash_combine_rows<__nv_bfloat16, 2>"
    made = faked("flash[splits=300,combine=narrow64]", 2, 1, 8, 11000)
    assert made[1][0] == "kdtr_flash_combine_narrow<__nv_bfloat16, 64, 8>"


def test_segments_force_the_work_table(faked):
    """segments=3: a stream-K cut every 3 tiles. The device scheduler (one CTA) runs first and writes the tables
    into the workspace; the work-table build (Merge.WORK_TABLE), launched dependent on it, runs a grid of the
    most pieces that cut can make at the capacity; then the cut jobs' merge, one row of CTAs per job the table
    can hold. segments=0 keeps the uniform grid."""
    from kdtr.kernels.flash import device_plan, schedule

    made, steps, ws, slots = faked("flash-sm90[segments=3]", 2, 64, 16, 1536, full=True)
    assert made[0] == ("kdtr_flash_schedule", (1, 1, 1), False)
    assert steps[0].smem == device_plan.SCHED_SMEM_BYTES and steps[0].block == (device_plan.SCHED_THREADS, 1, 1)
    assert made[1][0] == "kdtr_flash_sm90_verify<__nv_bfloat16, 0, 2, 0>" and made[1][2]  # dependent
    assert made[2] == ("kdtr_flash_combine_jobs<__nv_bfloat16, 64>", (8, 2 * 16, 1), True)
    sched = steps[1].args[1][0]
    assert all(s.args[-1][0] == sched for s in steps)  # one FlashSched for the three launches
    assert (sched["family"], sched["interval"], sched["row_tiles"], sched["max_jobs"]) == (schedule.Family.STREAM, 3, 16, 32)
    at_capacity = schedule.device_schedule([1536, 1536], 64, 16, 32, schedule.Recipe(schedule.Family.STREAM, 0, 3))
    assert len(at_capacity.pieces) <= sched["max_pieces"] == slots == made[1][1][0]
    assert sched["table_offset"] == slots * 64 * 513 * 4  # after the partials of every slot
    assert ws == sched["table_offset"] + 4 * device_plan.table_ints(slots, 32, 6, 4)
    assert faked("flash-sm90[segments=0]", 2, 65, 16, 1500)[0][0].endswith(", 0, 0>")


@pytest.mark.parametrize("mt", [1, 2, 4])
def test_flash_takes_the_forced_row_tile(faked, mt):
    made = faked(f"flash[mt={mt}]", 2, 9, 8, 3000)
    assert made[0][0] == f"kdtr_flash_verify<{mt}, __nv_bfloat16, 0>"


@pytest.mark.parametrize("spec", ["flash-sm90[xr=1,splits=3]", "flash-sm90-bug=merge-wrong-max[segments=5]",
                                  "flash[mt=2,splits=4]", "flash-sm90[merge=kernel,combine=narrow]"])
def test_the_spec_round_trips_through_the_kernels_name(faked, spec):
    """A child process (isolation) resolves the kernel again from kernel.name: same force, same launches."""
    k = resolve_kernel(spec)
    again = resolve_kernel(k.name)
    assert again.name == k.name and again.force == k.force and again.bug == k.bug
    assert faked(k.name, 2, 9, 8, 3000) == faked(spec, 2, 9, 8, 3000)


def _registers(step: Step) -> int:
    """The faked build's registers (load above)."""
    return next(iter(step.loaded.compiled.resources.values())).registers


@pytest.mark.parametrize("B, T, H, P", [(32, 1, 8, 32768), (1, 9, 8, 131072), (8, 65, 16, 8192)])
def test_occupancy_sm_120_plans_with_its_residency_and_pads_every_launch_to_it(faked, B, T, H, P):
    """flash[occupancy=sm_120] on the faked H200: the split plan counts sm_120's CTAs an SM (this GPU's 132 SMs),
    and every launch asks for the dynamic shared memory that holds the H200 to as many CTAs an SM as sm_120 holds
    of it unpadded; plain flash plans with the H200's residency and asks for what the build uses."""
    from kdtr.kernels.flash.arch import SM_90, SM_120
    from kdtr.kernels.flash.plan import Build, Device, Shape, occupancy, plan, resident_ctas

    cfg = CONFIGS["flash"]
    (plain, *_), steps, _, _ = faked("flash", B, T, H, P, full=True)
    made, emulated, _, _ = faked("flash[occupancy=sm_120]", B, T, H, P, full=True)
    k = resolve_kernel("flash")
    mt = int(plain[0].split("<")[1].split(",")[0])  # the row tile the plan chose
    threads, smem = k.variant.launch_shape(cfg, mt)
    assert steps[0].smem == smem and emulated[0].block == steps[0].block == (threads, 1, 1)
    regs = _registers(steps[0])
    for launches, ctas in ((steps, occupancy(threads, regs, smem, SM_90)), (emulated, occupancy(threads, regs, smem, SM_120))):
        assert launches[0].grid == plan(Shape(B, T, H, P), Device(H200_SMS), Build(mt, k.variant.bn(cfg, mt), ctas)).grid
    assert made[0][0] == plain[0]  # the same build
    unpadded = {0: smem}  # the merges ask for none
    for i, s in enumerate(emulated):
        want = occupancy(s.block[0], _registers(s), unpadded.get(i, 0), SM_120)
        assert resident_ctas(s.block[0], _registers(s), s.smem, SM_90) == want, (i, s.smem)
        assert s.smem >= unpadded.get(i, 0) and resident_ctas(s.block[0], _registers(s), s.smem + 128, SM_90) < want


def test_kimi_decode_b32_takes_fewer_splits_at_sm_120s_residency(faked):
    """T1 B32 P32k: sm_120 holds one 16-row CTA an SM (its 100 KB), the H200 more: half the slots, fewer splits."""
    plain, emulated = faked("flash", 32, 1, 8, 32768)[0], faked("flash[occupancy=sm_120]", 32, 1, 8, 32768)[0]
    assert plain[0] == emulated[0] and emulated[1][1] < plain[1][1]


def test_occupancy_sm_120_refuses_a_build_past_its_99_kb(faked, monkeypatch):
    monkeypatch.setitem(CONFIGS, "flash", {**CONFIGS["flash"], "SMEM_MT1": 110_000})
    assert faked("flash", 1, 1, 8, 4096)  # the H200 takes it
    with pytest.raises(ValueError) as info:
        faked("flash[occupancy=sm_120]", 1, 1, 8, 4096)
    assert str(info.value) == ("flash[occupancy=sm_120]: kdtr_flash_verify<1, __nv_bfloat16, 0>: 110000 bytes of shared "
                               "memory a CTA (static and dynamic) pass sm_120's 101376: the build cannot run there")


def test_the_padded_request_raises_the_kernels_limit_and_a_smaller_one_never_lowers_it():
    """launch.allow_smem: flash and flash[occupancy=sm_120] share each loaded build (one module a process), so the
    limit a padded launcher needs must survive a plain launcher prepared after it."""
    fn = types.SimpleNamespace(max_dynamic_shared_size_bytes=0)
    loaded = types.SimpleNamespace(function=fn)
    launch.allow_smem([Step(loaded, (1, 1, 1), (128, 1, 1), 232448)])
    assert fn.max_dynamic_shared_size_bytes == 232448
    launch.allow_smem([Step(loaded, (1, 1, 1), (128, 1, 1), 68188), Step(loaded, (1, 1, 1), (128, 1, 1), 40000)])
    assert fn.max_dynamic_shared_size_bytes == 232448
