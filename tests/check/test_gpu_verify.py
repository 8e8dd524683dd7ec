"""On a GPU: the built-in CUDA kernels pass the goldens, repeat bit-identically, and every planted
bug fails. `make test-gpu` runs these; the long suite needs KDTR_LONG=1 (its reference takes
minutes on a CPU)."""

import os
from pathlib import Path

import pytest

from kdtr.kernels.bugs import PLAIN, SHOWS_ON, Bug
from kdtr.check.compare import Status
from kdtr.kernels.registry import resolve_kernel, variant_name
from kdtr.kernels.launch import device_arch
from kdtr.golden.store import find_bundles
from kdtr.check.suite import run_verify

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("hopper_only")]
KERNELS = ("naive", "flash", "flash-sm90")


@pytest.fixture(scope="module")
def ci_paths():
    return find_bundles(["ci"])


def _describe(rep):
    return [(r.case, r.status.value, r.message) for r in rep.results if r.status is not Status.PASS]


@pytest.mark.parametrize("name", KERNELS)
def test_builtin_kernel_passes_ci_and_repeats_bit_identically(ci_paths, name):
    rep = run_verify(resolve_kernel(name), ci_paths, repeat=3)
    assert not rep.failed, _describe(rep)
    passed = [r for r in rep.results if r.status is Status.PASS]
    skipped = [r for r in rep.results if r.status is Status.SKIPPED]
    assert all(r.shape["kv"] == "fp32" for r in skipped), _describe(rep)  # flash takes bf16 only
    assert len(passed) >= 10


@pytest.mark.parametrize("mt", [1, 2, 4])
def test_flash_every_row_tile_passes_ci(ci_paths, mt):
    """The plan picks the row tile from the shape; force each (flash[mt=N]) so every instantiation is checked."""
    rep = run_verify(resolve_kernel(f"flash[mt={mt}]"), ci_paths)
    assert not rep.failed, _describe(rep)


@pytest.mark.parametrize("bug", PLAIN, ids=lambda b: b.slug)
@pytest.mark.parametrize("name", KERNELS)
def test_planted_bug_fails_ci(ci_paths, name, bug: Bug):
    rep = run_verify(resolve_kernel(variant_name(name, bug)), ci_paths)
    failed = [r for r in rep.results if r.status.failed]
    assert failed, f"{name} with {bug.slug} passed the ci suite"
    assert all(r.status in (Status.FAIL_NUMERIC, Status.NAN) for r in failed), _describe(rep)


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("KDTR_LONG"), reason="set KDTR_LONG=1 (generates the long suite)")
@pytest.mark.parametrize("name", KERNELS)
def test_builtin_kernel_passes_long(name):
    rep = run_verify(resolve_kernel(name), find_bundles(["long"], jobs=max(1, (os.cpu_count() or 2) // 2)))
    assert not rep.failed, _describe(rep)


MERGE_CASES = {  # force suffix, model, heads, budget, prefix lengths, the main kernel's {merge} and {xr}, splits at least
    "decode-in-kernel": ("[merge=kernel]", "kimi-k2", 8, 0, (6000, 2500), 1, 0, 32),  # the 64-row build
    "decode-combine": ("[merge=combine,xr=0,segments=0]", "kimi-k2", 8, 0, (6000, 2500), 0, 0, 32),
    "decode-transposed-combine": ("[xr=1,segments=0]", "kimi-k2", 8, 0, (50000, 9000), 0, 1, 128),  # the narrow combine
    "many-rows-combine": ("[xr=0,segments=0]", "deepseek-v3", 16, 64, (3000, 1700), 0, 0, 2),  # 2 x 17 row tiles
}
"""The uniform grid whose merge is under test (segments=0 where the model might take a work table)."""


@pytest.mark.parametrize("case", sorted(MERGE_CASES))
def test_flash_sm90_merges_are_exact_relaunchable_and_catch_the_merge_bug(case):
    """flash-sm90 merges its splits in the main kernel on one-wave decode grids (counters in the
    workspace) or through the combine launch: each matches the reference, a launcher run four times
    gives the bits of one run and leaves the counters at zero, and the planted merge bug fails on
    every path."""
    import numpy as np

    from kdtr.inputs.cases import CaseSpec, build_problem
    from kdtr.check.compare import compare
    from kdtr.kernels.launch import DeviceProblem, make_launcher
    from kdtr.golden.reference import reference
    from kdtr.golden.tolerances import default

    if device_arch() != "sm_90":
        pytest.skip("flash-sm90 needs an sm_90 GPU")
    force, model, heads, budget, prefix, main_merge, xr, min_splits = MERGE_CASES[case]
    spec = CaseSpec(model=model, heads=heads, prefix_lens=prefix, family="ddtree" if budget else "root",
                    budget=budget, page_size=64)
    prob, _ = build_problem(spec)
    want, tol = reference(prob)[0], default(spec.kv_dtype, spec.out_dtype, "out")
    dp = DeviceProblem(prob, spec.out_dtype)
    steps, ws, splits = resolve_kernel("flash-sm90" + force).steps(dp)
    (expr,) = steps[0].loaded.compiled.lowered
    assert splits >= min_splits and len(steps) == (1 if main_merge else 2) and f", {main_merge}, {xr}>" in expr, expr
    go = make_launcher(dp, steps, ws, splits)
    go()
    once = dp.download()[0].copy()
    for _ in range(3):
        go()
    again = dp.download()[0]
    assert np.array_equal(once, again)
    assert not compare(again, want, tol).status.failed
    n = prob.B * -(-prob.T * prob.H // 64) * 2  # uint32 counters [B, row tiles, 2] end the workspace
    assert int(go.workspace[-n * 4:].get().view(np.uint32).sum()) == 0
    buggy = resolve_kernel(variant_name("flash-sm90", Bug.MERGE_WRONG_MAX) + force).run(prob, spec.out_dtype)
    assert compare(buggy.out, want, tol).status.failed


@pytest.mark.parametrize("name,mt", [("flash", 1), ("flash", 4), ("flash-sm90", 4)])
def test_split_partials_cover_the_keys_python_says(name, mt):
    """Each split's partial lse (workspace) equals the lse over the keys kdtr/kernels/flash/plan.py's split_ranges
    gives that split (+ the tree tail for the last), in the KV tiles of the row tile that ran (flash's 16- and
    64-row tiles take 16- and 32-key tiles): the plan's cost model and the kernels' split partition
    (cuda/flash_split.cuh) are one rule written twice, checked here. A shifted boundary of one 16-key tile moves
    a split's lse by ~0.01-0.1; the bound is 2e-3."""
    import numpy as np

    from kdtr.inputs.cases import CaseSpec, build_problem
    from kdtr.kernels.flash.plan import split_ranges
    from kdtr.kernels.launch import DeviceProblem, make_launcher
    from kdtr.inputs.presets import DK
    from kdtr.inputs.trees import unpack_mask

    spec = CaseSpec(model="kimi-k2", heads=8, prefix_lens=(3100, 700), family="ddtree", budget=40, page_size=64)
    prob, _ = build_problem(spec)
    kernel = resolve_kernel(f"{name}[splits=7,merge=combine,mt={mt}]")
    dp = DeviceProblem(prob, spec.out_dtype)
    steps, ws, splits = kernel.steps(dp)
    assert splits == 7
    go = make_launcher(dp, steps, ws, splits)
    go()
    B, T, H, R = prob.B, prob.T, prob.H, prob.T * prob.H
    lse_ws = go.workspace[: B * splits * R * (512 + 1) * 4].get().view(np.float32)[B * splits * R * 512:]
    lse_ws = lse_ws.reshape(B, splits, R)
    bn = kernel.variant.bn(kernel.config(), mt)
    for b in range(B):
        P = int(prob.prefix_lens[b])
        q = prob.q[b].reshape(R, DK).astype(np.float64) * prob.scale  # [R, 576]
        tail = np.repeat(unpack_mask(prob.tree_mask[b], T), H, axis=0)  # [R, T] rows see ancestors + self
        for s, (lo, hi) in enumerate(split_ranges(P, T, splits, bn)):
            scores = q @ prob.gather_kv(b, lo, hi).T  # [R, hi - lo]
            if s == splits - 1:
                st = q @ prob.gather_kv(b, P, P + T).T
                scores = np.concatenate([scores, np.where(tail, st, -np.inf)], axis=1)
            m = scores.max(axis=1, initial=-np.inf)
            want = m + np.log(np.exp(scores - np.where(np.isfinite(m), m, 0)[:, None]).sum(axis=1))
            got = lse_ws[b, s].astype(np.float64)
            assert np.array_equal(np.isneginf(got), np.isneginf(want)), f"{name} b={b} split {s}: empty rows differ"
            live = np.isfinite(want)
            assert np.abs(got[live] - want[live]).max(initial=0) < 2e-3, f"{name} b={b} split {s} [{lo}, {hi})"


@pytest.mark.parametrize("page_size", [64, 1])
def test_flash_sm90_reads_full_prefix_tiles_through_the_tensor_map(page_size):
    """flash-sm90 copies the full prefix tiles of a page-aligned cache with TMA, and everything
    else with cp.async: a tensor map shifted by one cache row must break a page-64 run (so the
    map is what those tiles are read through) and must not touch a page-1 run (where no tile is
    read through it); the right map passes both."""
    from dataclasses import replace

    from kdtr.kernels.flash import tma
    from kdtr.inputs.cases import CaseSpec, build_problem
    from kdtr.check.compare import compare
    from kdtr.kernels.launch import DeviceProblem, make_launcher
    from kdtr.inputs.presets import DK
    from kdtr.golden.reference import reference
    from kdtr.golden.tolerances import default

    if device_arch() != "sm_90":
        pytest.skip("flash-sm90 needs an sm_90 GPU")
    spec = CaseSpec(model="deepseek-v3", heads=16, prefix_lens=(2000, 333), family="ddtree", budget=40,
                    page_size=page_size)
    prob, _ = build_problem(spec)
    want, tol = reference(prob)[0], default(spec.kv_dtype, spec.out_dtype, "out")
    kernel = resolve_kernel("flash-sm90")
    dp = DeviceProblem(prob, spec.out_dtype)
    steps, ws, splits = kernel.steps(dp)
    cfg = kernel.config()
    full = tma.kv_map_spec(prob.kv_cache.shape[0], prob.page_size, DK, cfg["TMA_BOX_COLS"], cfg["BN_MT4"], cfg["TMA_BOX_SLABS"])
    dims = (full.dims[0], full.dims[1] - 1, *full.dims[2:])
    one_less = tma.KvMapSpec(dims, full.strides, full.box)  # stays inside the cache
    shifted = tma.encode(one_less, dp.kv_cache.data.ptr + DK * 2)  # row r of the map is cache row r + 1
    results = {}
    for label, args in (("right", steps[0].args), ("shifted", (shifted, *steps[0].args[1:]))):
        go = make_launcher(dp, [replace(steps[0], args=args), *steps[1:]], ws, splits)
        dp.poison()
        go()
        results[label] = compare(dp.download()[0], want, tol).status
    assert not results["right"].failed
    assert results["shifted"].failed == (page_size == 64), results


@pytest.mark.parametrize("combine,splits", [("rows", 7), ("rows", 4), ("split", 7), ("narrow32", 7), ("narrow64", 7)])
@pytest.mark.parametrize("name", ["flash", "flash-sm90"])
def test_both_combine_kernels_merge_exactly_and_catch_the_merge_bug(name, combine, splits):
    """kdtr_flash_combine_rows (a warp per half row for 7 splits, per whole row for 4), kdtr_flash_combine (a CTA
    per row, column chunks) and kdtr_flash_combine_narrow (a CTA per row and 32 or 64 columns, 4 warps for 7
    splits) each merge the forced splits of a 1040-row request to the reference, relaunch bit-identically, and
    the planted merge bug fails through each."""
    import numpy as np

    from kdtr.inputs.cases import CaseSpec, build_problem
    from kdtr.check.compare import compare
    from kdtr.kernels.flash.combine import COMBINE, COMBINE_NARROW, COMBINE_ROWS
    from kdtr.kernels.launch import CTYPES, DeviceProblem, make_launcher
    from kdtr.golden.reference import reference
    from kdtr.golden.tolerances import default

    force = f"[splits={splits},merge=combine,combine={combine}]"
    spec = CaseSpec(model="deepseek-v3", heads=16, prefix_lens=(1500, 900), family="ddtree", budget=64, page_size=64)
    prob, _ = build_problem(spec)
    (want, want_lse), tol = reference(prob), default(spec.kv_dtype, spec.out_dtype, "out")
    dp = DeviceProblem(prob, spec.out_dtype)
    steps, ws, planned = resolve_kernel(name + force).steps(dp)
    expect = {"rows": COMBINE_ROWS.format(out="{out}", parts=2 if splits > 4 else 1), "split": COMBINE}.get(
        combine, COMBINE_NARROW.format(out="{out}", cols=combine[6:], warps=4))
    assert planned == splits and len(steps) == 2
    assert set(steps[1].loaded.compiled.lowered) == {expect.format(out=CTYPES[spec.out_dtype])}
    go = make_launcher(dp, steps, ws, planned)
    go()
    once, lse = (a.copy() for a in dp.download())
    go()
    assert np.array_equal(once, dp.download()[0])
    assert not compare(once, want, tol).status.failed
    assert not compare(lse, want_lse, default(spec.kv_dtype, spec.out_dtype, "lse"), "lse").status.failed  # half rows: z 0
    buggy = resolve_kernel(variant_name(name, Bug.MERGE_WRONG_MAX) + force).run(prob, spec.out_dtype)
    assert compare(buggy.out, want, tol).status.failed


@pytest.mark.parametrize("width", ["narrow32", "narrow64"])
@pytest.mark.parametrize("xr", ["0", "1"])
@pytest.mark.parametrize("name", ["flash", "flash-sm90"])
def test_narrow_combine_merges_hundreds_of_splits_some_empty(name, xr, width):
    """Kimi decode (8 rows a request, two requests) as its plan merges it on a few rows:
    kdtr_flash_combine_narrow of either width, here over 300 forced splits, more than its one step
    (288 splits at 32 columns, 144 at 64), and the splits past the shorter prefix's tiles see no key
    (lse -inf). Both requests' out and lse match the reference (64-row tiles, and all rows transposed where
    flash-sm90 has them), a relaunch gives the same bits, and the planted merge bug fails."""
    from kdtr.inputs.cases import CaseSpec, build_problem
    from kdtr.check.compare import compare
    from kdtr.kernels.flash.combine import COMBINE_NARROW
    from kdtr.kernels.launch import CTYPES, DeviceProblem, make_launcher
    from kdtr.golden.reference import reference
    from kdtr.golden.tolerances import default

    if xr == "1" and name != "flash-sm90":
        pytest.skip("transposed rows are flash-sm90's")
    force = f"[splits=300,merge=combine,combine={width}" + (f",xr={xr}]" if name == "flash-sm90" else "]")
    spec = CaseSpec(model="kimi-k2", heads=8, prefix_lens=(11000, 5000), family="root", budget=0, page_size=64)
    prob, _ = build_problem(spec)
    want = reference(prob)
    dp = DeviceProblem(prob, spec.out_dtype)
    steps, ws, splits = resolve_kernel(name + force).steps(dp)
    assert splits == 300 and len(steps) == 2, (splits, len(steps))
    # 300 splits: past one step of either width, so 8 warps
    assert set(steps[1].loaded.compiled.lowered) == {COMBINE_NARROW.format(out=CTYPES[spec.out_dtype], cols=width[6:], warps=8)}
    relaunch_matches(dp, make_launcher(dp, steps, ws, splits), want, spec.kv_dtype, spec.out_dtype)
    buggy = resolve_kernel(variant_name(name, Bug.MERGE_WRONG_MAX) + force).run(prob, spec.out_dtype)
    assert compare(buggy.out, want[0], default(spec.kv_dtype, spec.out_dtype, "out")).status.failed


def relaunch_matches(dp, go, want, kv_dtype: str, out_dtype: str) -> None:
    """Launch ``go`` on poisoned outputs, then again: the same bits twice, and out and lse within the
    calibrated tolerances of the reference ``want`` = (out, lse)."""
    import numpy as np

    from kdtr.check.compare import compare
    from kdtr.golden.tolerances import default

    dp.poison()
    go()
    out, lse = (a.copy() for a in dp.download())
    go()
    assert all(np.array_equal(x, y) for x, y in zip((out, lse), dp.download()))
    assert not compare(out, want[0], default(kv_dtype, out_dtype, "out")).status.failed
    assert not compare(lse, want[1], default(kv_dtype, out_dtype, "lse"), "lse").status.failed


def unseen(bug: Bug, spec) -> str | None:
    """Why ``spec``'s problem cannot show planted ``bug`` (bugs.SHOWS_ON), or None where it can."""
    T, B = (1 if spec.family == "root" else spec.budget + 1), len(spec.prefix_lens)
    lacks = {
        Bug.SIBLING_VISIBLE: spec.family in ("chain", "root"),
        Bug.CAUSAL_MASK: spec.family in ("chain", "root"),
        Bug.MASK_STRIDE: T % 32 != 0,
        Bug.MASK_REQUEST0: B == 1 or spec.family in ("chain", "root", "star"),  # one tree for every request
        Bug.Q_HEAD_MAJOR: spec.heads == 1 or T == 1,
        Bug.BLOCK_TABLE_STRIDE: B == 1,
        Bug.TAIL_POSITION: max(spec.prefix_lens) == 0,
        Bug.NO_RUNNING_MAX: getattr(spec, "values", "normal") == "normal" and spec.scale is None,  # scores within +-17
        Bug.OUT_TRUNCATE: spec.out_dtype != "bf16",
    }
    return f"{bug.slug} needs {SHOWS_ON[bug]}" if lacks.get(bug) else None


def flash_sm90_bug_shows(spec, bug: Bug, force: str, nodes=slice(None)) -> None:
    """flash-sm90 with plan suffix ``force`` on ``spec``'s problem matches the reference over tree nodes
    ``nodes`` and its planted-``bug`` variant (the same suffix) does not (out or lse, calibrated tolerances,
    out's rounding bias). Skipped for a bug the problem cannot show (unseen)."""
    from kdtr.inputs.cases import build_problem
    from kdtr.check.compare import compare
    from kdtr.golden.reference import reference
    from kdtr.golden.tolerances import default

    if why := unseen(bug, spec):
        pytest.skip(why)
    prob, _ = build_problem(spec)
    want = [x[:, nodes] for x in reference(prob)]  # out [B, T, H, 512], lse [B, T, H] over the nodes checked
    tols = [default(spec.kv_dtype, spec.out_dtype, o) for o in ("out", "lse")]

    def failed(kernel: str) -> bool:
        res = resolve_kernel(kernel + force).run(prob, spec.out_dtype)
        return (compare(res.out[:, nodes], want[0], tols[0], "out", out_dtype=spec.out_dtype).status.failed
                or compare(res.lse[:, nodes], want[1], tols[1], "lse").status.failed)

    assert not failed("flash-sm90")
    assert failed(variant_name("flash-sm90", bug)), f"{bug.slug} left nodes {nodes} right"


def flash_sm90_steps(force: str, heads: int, budget: int, prefix, page: int, family: str, out_dtype: str):
    """The launches of flash-sm90 with plan suffix ``force`` for a Kimi case: (spec, problem, reference
    (out, lse), DeviceProblem, steps, workspace bytes, splits)."""
    from kdtr.inputs.cases import CaseSpec, build_problem
    from kdtr.kernels.launch import DeviceProblem
    from kdtr.golden.reference import reference

    spec = CaseSpec(model="kimi-k2", heads=heads, prefix_lens=prefix, family=family, budget=budget, page_size=page,
                    out_dtype=out_dtype)
    prob, _ = build_problem(spec)
    dp = DeviceProblem(prob, out_dtype)
    return (spec, prob, reference(prob), dp, *resolve_kernel("flash-sm90" + force).steps(dp))


XR_CASES = {  # (heads, budget, prefix lengths, page size, tree family, out dtype, forced splits)
    "kimi-t9-split": (8, 8, (3000, 77), 64, "ddtree", "bf16", None),  # 72 rows: one CTA per split + combine
    "136-rows-page1": (8, 16, (500,), 1, "ddtree", "fp32", None),     # the second of two tiles takes 8
    "65-rows-direct": (5, 12, (0, 40), 64, "star", "bf16", 1),        # one split; a request without prefix
    "kimi-t9-3splits-page1": (8, 8, (2100, 64), 1, "chain", "bf16", 3),
}


def xr_force(splits) -> str:
    """Transposed rows wherever they apply (the plan's model takes them for many requests only), the split count forced."""
    return f"[splits={splits},xr=1]" if splits else "[xr=1]"


@pytest.mark.parametrize("case", sorted(XR_CASES))
def test_flash_sm90_transposed_rows_match_the_reference(case):
    """Requests of 64 k + 1..8 rows run their last rows as transposed products inside the last row
    tile (kdtr/kernels/flash/plan.py's extra_row_tiles): flash-sm90[xr=1] takes the ROWS_EXTRA build with one
    CTA fewer per split, out and lse match the reference in every row, and a relaunch gives the same bits."""
    from kdtr.kernels.launch import make_launcher

    if device_arch() != "sm_90":
        pytest.skip("flash-sm90 needs an sm_90 GPU")
    *shape, splits = XR_CASES[case]
    spec, prob, want, dp, steps, ws, n_splits = flash_sm90_steps(xr_force(splits), *shape)
    (expr,) = steps[0].loaded.compiled.lowered
    R = prob.T * prob.H
    assert expr.endswith(", 8>") and steps[0].grid[0] == R // 64, (expr, steps[0].grid)
    relaunch_matches(dp, make_launcher(dp, steps, ws, n_splits), want, spec.kv_dtype, spec.out_dtype)


@pytest.mark.parametrize("bug", PLAIN, ids=lambda b: b.slug)
def test_flash_sm90_transposed_rows_carry_every_planted_bug(bug: Bug):
    """Each planted bug shows in the transposed rows alone (rows 64..71 of a 72-row star tree,
    node 8, whose previous node is a sibling): those rows run the same operator, not a copy that
    the 64 wgmma rows would hide. Two requests: P = 700 (pages and tiles for the page and tile
    bugs to hit) and P = 1 (its one prefix key is the one the drop-key bugs lose)."""
    from kdtr.inputs.cases import CaseSpec

    if device_arch() != "sm_90":
        pytest.skip("flash-sm90 needs an sm_90 GPU")
    spec = CaseSpec(model="kimi-k2", heads=8, prefix_lens=(700, 1), family="star", budget=8, page_size=64)
    flash_sm90_bug_shows(spec, bug, "[xr=1]", slice(8, None))  # rows 64..71 are node 8


TRANSPOSED_CASES = {  # (heads, budget, prefix lengths, page size, tree family, out dtype, forced splits)
    "kimi-decode-edges": (8, 0, (0, 1, 31, 32, 33, 64, 65, 2500), 64, "root", "bf16", None),
    "kimi-decode-page1-fp32-out": (8, 0, (4000, 77), 1, "root", "fp32", None),
    "2-heads-4-nodes": (2, 3, (700, 0), 64, "ddtree", "bf16", None),
    "8-node-chain-direct": (1, 7, (300,), 64, "chain", "bf16", 1),  # one split: out written directly
    "5-node-star-3splits-page1": (1, 4, (2100, 64), 1, "star", "bf16", 3),
    "kimi-decode-page1-171-splits": (8, 0, (16384,), 1, "root", "fp32", None),  # the planned B1 grid (two CTAs an SM)
}


@pytest.mark.parametrize("case", sorted(TRANSPOSED_CASES))
def test_flash_sm90_all_rows_transposed_match_the_reference(case):
    """Requests of 1..8 rows (Kimi decode) run as ROWS_TRANSPOSED (the plan's choice, forced here too): one
    row tile whose rows are all transposed products, two CTAs per SM. out and lse match the reference in every
    row, over prefix edges, both page sizes, trees whose rows see different tail keys and one split as well
    as several (171 on one request: more than the SMs), and a relaunch gives the same bits."""
    from kdtr.kernels.flash.force import RowLayout
    from kdtr.kernels.launch import make_launcher

    if device_arch() != "sm_90":
        pytest.skip("flash-sm90 needs an sm_90 GPU")
    *shape, splits = TRANSPOSED_CASES[case]
    spec, prob, want, dp, steps, ws, n_splits = flash_sm90_steps(xr_force(splits), *shape)
    assert prob.T * prob.H <= 8
    (expr,) = steps[0].loaded.compiled.lowered
    assert expr.endswith(f", {int(RowLayout.TRANSPOSED)}>") and steps[0].grid[0] == 1, (expr, steps[0].grid)
    assert n_splits == (splits or n_splits) and len(steps) == (1 if n_splits == 1 else 2)
    relaunch_matches(dp, make_launcher(dp, steps, ws, n_splits), want, spec.kv_dtype, spec.out_dtype)


@pytest.mark.parametrize("bug", PLAIN, ids=lambda b: b.slug)
def test_flash_sm90_all_rows_transposed_carry_every_planted_bug(bug: Bug):
    """Each planted bug shows when every row is transposed (ROWS_TRANSPOSED): an 8-node star (siblings for
    the sibling bug), P = 700 (pages and a partial tile) and P = 1 (the one prefix key the drop-key bug loses)."""
    from kdtr.inputs.cases import CaseSpec

    if device_arch() != "sm_90":
        pytest.skip("flash-sm90 needs an sm_90 GPU")
    flash_sm90_bug_shows(CaseSpec(model="kimi-k2", heads=1, prefix_lens=(700, 1), family="star", budget=7, page_size=64),
                   bug, "[xr=1]")


WORK_TABLE_CASES = {  # (heads, budget, prefix lengths, page size, out dtype, force)
    "t65-mixed-page64": (16, 64, (1500, 0, 333, 2900), 64, "bf16", "[segments=7]"),  # 17 row tiles; a request without prefix
    "t65-page1-fp32": (16, 64, (900, 41), 1, "fp32", "[segments=5]"),
    "t17-cut-every-tile": (16, 16, (700, 64), 64, "bf16", "[segments=2]"),             # 272 rows, many 2-tile pieces
    "t65-model-choice": (16, 64, (2000, 1999, 1500, 1700, 2100, 1800, 1900, 2000), 64, "bf16", "[segments=1]"),
}


@pytest.mark.parametrize("case", sorted(WORK_TABLE_CASES))
def test_flash_sm90_work_table_matches_the_reference(case):
    """The work table (kdtr/kernels/flash/schedule.py, Merge.WORK_TABLE): pieces cut anywhere on a tile boundary
    across mixed prefix lengths, pages of 64 and 1, longest first; cut jobs merged by kdtr_flash_combine_jobs,
    whole ones written directly. out and lse match the reference and a relaunch gives the same bits."""
    from kdtr.inputs.cases import CaseSpec, build_problem
    from kdtr.kernels.launch import DeviceProblem, make_launcher
    from kdtr.golden.reference import reference

    if device_arch() != "sm_90":
        pytest.skip("flash-sm90 needs an sm_90 GPU")
    heads, budget, prefix, page, out_dtype, force = WORK_TABLE_CASES[case]
    spec = CaseSpec(model="deepseek-v3", heads=heads, prefix_lens=prefix, family="ddtree", budget=budget,
                    page_size=page, out_dtype=out_dtype)
    prob, _ = build_problem(spec)
    want_out, want_lse = reference(prob)
    dp = DeviceProblem(prob, out_dtype)
    steps, ws, slots = resolve_kernel("flash-sm90" + force).steps(dp)
    (expr,) = steps[1].loaded.compiled.lowered  # after the device scheduler, which writes the tables
    assert list(steps[0].loaded.compiled.lowered) == ["kdtr_flash_schedule"]
    assert ", 2, 0>" in expr and len(steps) == 3 and slots > 1, (expr, len(steps))
    assert all(e.startswith("kdtr_flash_combine_jobs<") for e in steps[2].loaded.compiled.lowered)
    relaunch_matches(dp, make_launcher(dp, steps, ws, slots), (want_out, want_lse), spec.kv_dtype, out_dtype)


@pytest.mark.parametrize("bug", PLAIN, ids=lambda b: b.slug)
def test_flash_sm90_work_table_carries_every_planted_bug(bug: Bug):
    """Each planted bug fails through the work table too (pieces of <= 5 tiles, so cut jobs merge): the
    work-table build runs the same operator, and the merge bug reaches kdtr_flash_combine_jobs."""
    from kdtr.inputs.cases import CaseSpec

    if device_arch() != "sm_90":
        pytest.skip("flash-sm90 needs an sm_90 GPU")
    flash_sm90_bug_shows(CaseSpec(model="deepseek-v3", heads=16, prefix_lens=(700, 1), family="ddtree", budget=16,
                            page_size=64), bug, "[segments=5]")


FLASH_SM90_FORCED_CI = {"transposed-rows": "flash-sm90[xr=1]", "work-table": "flash-sm90[segments=1]",
                  "in-kernel-merge": "flash-sm90[merge=kernel]", "combine-launch": "flash-sm90[merge=combine]"}
"""flash-sm90 paths forced wherever they apply: ci has requests of 65, 68, 130, 257 and 1025 rows
(transposed rows); the work table takes the model's best cut even without a gain (decode plans that merge
in-kernel or take transposed rows keep theirs); merge=kernel merges in the kernel wherever the grid is
one wave (decode), merge=combine never."""


@pytest.mark.parametrize("path", sorted(FLASH_SM90_FORCED_CI))
def test_flash_sm90_passes_ci_with_a_path_forced(path, ci_paths):
    """Every ci case passes bit-identically over three launches with the path forced on, as with
    the plan's own choice (each case in its own child process: the spec's suffix travels in kernel.name)."""
    if device_arch() != "sm_90":
        pytest.skip("flash-sm90 needs an sm_90 GPU")
    rep = run_verify(resolve_kernel(FLASH_SM90_FORCED_CI[path]), ci_paths, repeat=3)
    assert rep.kernel == FLASH_SM90_FORCED_CI[path] and not rep.failed, _describe(rep)
    assert sum(r.status is Status.PASS for r in rep.results) >= 10


@pytest.mark.parametrize("wait", [0, 1])
def test_dependent_launch_overlaps_and_its_wait_orders_it(wait):
    """kdtr/kernels/pdl.py on this stream: a secondary launched dependent on a primary that releases it and
    then spins 2 ms runs early (sees the primary's flag still 0) without kdtr::pdl_wait(), and after
    the primary with it; a plain launch always after. Guards the combine's dependent launch: were the
    attribute ignored, the timings that credit it would be wrong; were the wait not ordering, the
    merge would read partials not yet written."""
    import numpy as np

    from kdtr.kernels import pdl
    from kdtr.kernels.launch import cupy_module, function_ptr, load_function, pdl_enabled

    if not pdl_enabled():
        pytest.skip("dependent launches need sm_90+")
    cp = cupy_module()
    src = Path(__file__).resolve().parents[1] / "cuda" / "pdl_probe.cu"
    primary, secondary = (load_function(src, n).function for n in ("kdtr_pdl_primary", "kdtr_pdl_secondary"))
    flag, seen = cp.zeros(1, cp.uint32), cp.full(1, 7, cp.uint32)
    stream = cp.cuda.get_current_stream().ptr
    for dependent in (True, False):
        flag[:] = 0
        seen[:] = 7
        primary((1,), (1,), (flag, np.int64(2_000_000)))
        if dependent:
            pdl.prepare(function_ptr(secondary), (1, 1, 1), (1, 1, 1), 0, (flag, seen, np.int32(wait)))(stream)
        else:
            secondary((1,), (1,), (flag, seen, np.int32(wait)))
        cp.cuda.runtime.deviceSynchronize()
        assert int(seen.get()[0]) == (0 if dependent and not wait else 1), (dependent, wait)
