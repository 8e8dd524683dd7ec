"""On an sm_90 GPU: the device half of the flash plan.

The device scheduler (kdtr_flash_schedule, cuda/flash_schedule.cuh) writes, for prefix lengths the host never saw,
exactly the work and job tables that kdtr/kernels/flash/schedule.py's mirror computes; and the flash kernels,
prepared and captured in a CUDA graph at a server's dummy lengths, replay right at the real ones, while the
planted baked-lengths launch and the host-built work table it reproduces replay wrong."""

from __future__ import annotations

import numpy as np
import pytest

from kdtr.inputs.cases import CaseSpec, build_problem
from kdtr.kernels import contract
from kdtr.kernels.flash import device_plan, schedule
from kdtr.kernels.registry import resolve_kernel

pytestmark = pytest.mark.gpu
BN, ROWS = 32, 64


@pytest.fixture(autouse=True)
def _hopper_only():
    from kdtr.kernels.launch import device_arch

    if device_arch() != "sm_90":
        pytest.skip(f"the device scheduler is flash-sm90's (sm_90); this GPU is {device_arch()}")


def run_scheduler(P, T, row_tiles, recipe, max_pieces):
    """The scheduler's tables for prefix lengths P: (work [pieces, 6], jobs [cut jobs, 4]) from the device."""
    from kdtr.kernels.launch import cupy_module

    cp = cupy_module()
    kernel = resolve_kernel("flash-sm90")
    loaded = kernel._load(device_plan.SCHEDULE_KERNEL)
    B, jobs = len(P), len(P) * row_tiles
    prefix = cp.asarray(np.asarray(P, np.int32))
    ints = device_plan.table_ints(max_pieces, jobs, 6, 4)
    ws = cp.full(ints, -7, cp.int32)  # garbage: the scheduler must write what it hands on
    params = contract.pack_params(q=0, kv_cache=0, block_table=0, prefix_lens=prefix.data.ptr, tree_mask=0, out=0,
                                  lse=0, workspace=ws.data.ptr, B=B, T=T, H=1, page_size=64, max_pages=1, mask_words=1,
                                  num_pages=1, num_splits=max_pieces, scale=1.0)
    splits = cp.ones(1, cp.int32)
    sched = device_plan.pack(splits=splits.data.ptr, table_offset=0, tiles_cap=0, tile_shift=5, max_pieces=max_pieces,
                             max_jobs=jobs, family=int(recipe.family), target=recipe.target, interval=recipe.interval,
                             whole=recipe.whole, row_tiles=row_tiles, rows_per_tile=ROWS)
    loaded.function.max_dynamic_shared_size_bytes = device_plan.SCHED_SMEM_BYTES
    loaded.function((1, 1, 1), (device_plan.SCHED_THREADS, 1, 1), (contract.as_kernel_arg(params), sched),
                    shared_mem=device_plan.SCHED_SMEM_BYTES)
    cp.cuda.runtime.deviceSynchronize()
    table = ws.get()
    n_pieces, n_jobs = int(table[0]), int(table[1])
    work = table[4:4 + max_pieces * 6].reshape(max_pieces, 6)[:n_pieces]
    job_rows = table[4 + max_pieces * 6:4 + max_pieces * 6 + jobs * 4].reshape(jobs, 4)[:n_jobs]
    return work, job_rows


RECIPES = [schedule.Recipe(schedule.Family.ALIGNED, 132), schedule.Recipe(schedule.Family.ALIGNED, 528),
           schedule.Recipe(schedule.Family.WHOLE, 132, whole=132), schedule.Recipe(schedule.Family.STREAM, 132),
           schedule.Recipe(schedule.Family.STREAM, 0, interval=40)]
LENGTHS = {"uniform-8k": (8192,) * 8, "mixed": (8192, 0, 31, 4097, 100, 2500, 64, 8191),
           "zeros": (0,) * 9, "one-long": (32768,)}


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.label)
@pytest.mark.parametrize("lengths", sorted(LENGTHS))
def test_the_device_scheduler_writes_the_mirrors_tables(recipe, lengths):
    P, T, row_tiles = LENGTHS[lengths], 65, 17
    if recipe.family is schedule.Family.WHOLE and len(P) * row_tiles <= recipe.whole:
        pytest.skip("the whole-jobs recipe needs more jobs than it walks whole")
    max_pieces = recipe.max_pieces(len(P) * row_tiles, 32768 // BN + 3)
    assert max_pieces <= device_plan.SCHED_MAX_PIECES  # the host never plans more (plan.MAX_TABLE_PIECES): a trap
    work, jobs = run_scheduler(P, T, row_tiles, recipe, max_pieces)
    want_work, want_jobs = schedule.device_schedule(P, T, row_tiles, BN, recipe).tables(np.asarray(P), BN, ROWS)
    assert np.array_equal(work, want_work) and np.array_equal(jobs, want_jobs)


GRAPH_CASES = {  # one layout each; captured at P = 0, 1 (and 1024 where it fits), replayed at these lengths
    "kimi-decode": dict(model="kimi-k2", heads=8, prefix_lens=(3000, 17, 0), family="root", budget=0),
    "kimi-t9": dict(model="kimi-k2", heads=8, prefix_lens=(2100, 700), budget=8),
    "dsv3-t65": dict(model="deepseek-v3", heads=16, prefix_lens=(1500, 5, 2048), budget=64),
}
GRAPH_KERNELS = ("flash", "flash-sm90", "flash-sm90[segments=1]", "flash-sm90[merge=kernel]", "naive")


def capture_layout(problem, fill: int):
    """The same buffers as ``problem`` with every prefix length ``fill`` and a chain tree (what a server
    captures at)."""
    from dataclasses import replace

    from kdtr.inputs.trees import chain

    chain_words = np.stack([chain(problem.T).mask_words()] * problem.B).astype(np.uint32)
    return replace(problem, prefix_lens=np.full(problem.B, fill, np.int32), tree_mask=chain_words)


@pytest.mark.parametrize("name", GRAPH_KERNELS)
@pytest.mark.parametrize("case", sorted(GRAPH_CASES))
def test_captured_at_dummy_lengths_the_kernels_replay_right(case, name):
    from kdtr.check.compare import compare
    from kdtr.golden.reference import reference
    from kdtr.golden.tolerances import default

    problem = build_problem(CaseSpec(**GRAPH_CASES[case]))[0]
    want_out, want_lse = reference(problem)
    kernel = resolve_kernel(name)
    for fill in (0, 1):
        run = kernel.graph(capture_layout(problem, fill), "bf16")
        run.load(problem)
        first, again = run.replay(), run.replay()
        assert compare(first.out, want_out, default("bf16", "bf16", "out")).status.ok, (case, name, fill)
        assert compare(first.lse, want_lse, default("bf16", "bf16", "lse"), "lse").status.ok, (case, name, fill)
        assert first.out.tobytes() == again.out.tobytes()


@pytest.mark.parametrize("name", ["flash-bug=baked-lengths", "flash-sm90-bug=baked-lengths",
                                  "flash-sm90-bug=baked-lengths[segments=1]", "naive-bug=baked-lengths"])
def test_a_launch_that_bakes_the_hosts_lengths_replays_wrong(name):
    """The planted bug: right when prepared at the real lengths, wrong when captured at P = 1. On flash-sm90 with a
    work table it is the host-built table the kernel had before its tables moved to the device (captured with
    lengths (8192, 100) and replayed at (300, 8100), it gave NaN)."""
    from kdtr.check.compare import compare
    from kdtr.golden.reference import reference
    from kdtr.golden.tolerances import default

    problem = build_problem(CaseSpec(model="deepseek-v3", heads=16, prefix_lens=(300, 8100), budget=64))[0]
    want_out, _ = reference(problem)
    kernel = resolve_kernel(name)
    assert compare(kernel.run(problem, "bf16").out, want_out, default("bf16", "bf16", "out")).status.ok
    before = build_problem(CaseSpec(model="deepseek-v3", heads=16, prefix_lens=(8100, 300), budget=64))[0]
    run = kernel.graph(before, "bf16")
    run.load(problem)
    assert compare(run.replay().out, want_out, default("bf16", "bf16", "out")).status.failed
