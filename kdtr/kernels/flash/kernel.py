"""The flash kernels and their one- or two-launch run.

Two kernels share the operator, the split plan, the workspace and the merge
(cuda/flash_split.cuh): ``flash`` (cuda/flash.cu, mma.sync: sm_80, sm_90, sm_120) and
``flash-sm90`` (cuda/flash_sm90.cu, wgmma: sm_90a only). Each is a FlashVariant below; FlashKernel
loads the builds that kdtr/kernels/flash/plan.py's plan names and lists their launches (the main
kernel, then the split merge, dependent on it where the device allows: kdtr/kernels/pdl.py). A Force
(kdtr/kernels/flash/force.py, from the kernel spec's suffix) overrides the plan's choices; its ``occupancy``
plans and launches ``flash`` under another arch's residency (FlashKernel.steps).
Tile constants come from the compiled module (its ``*_config`` array), never restated here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from kdtr.inputs.presets import DK, DV
from kdtr.kernels.bugs import Bug, kernel_bug
from kdtr.kernels.flash import device_plan
from kdtr.kernels.flash.combine import COMBINE, COMBINE_JOBS, combine_launch
from kdtr.kernels.flash.force import Force, Merge, RowLayout
from kdtr.kernels.flash.arch import EMULATED_ARCHS, ArchLimits
from kdtr.kernels.flash.plan import (Build, Device, Shape, choose_row_tile, choose_work_table, emulated_smem, occupancy,
                                    row_tile_choices)
from kdtr.kernels.launch_types import Step
from kdtr.kernels.nvrtc import CUDA_DIR

DEPENDENT_PREFIX = "kdtr_flash_combine"
"""The merge kernels open with kdtr::pdl_wait(): launched after the main kernel, they are launched
dependent on it (kdtr/kernels/pdl.py; tests/kernels/test_pdl.py checks each kernel so named waits first)."""
PROFILE_DEFINE = "KDTR_PROFILE"
"""The one compile switch (cuda/profile.cuh): loop-section cycle counters, read by tools/profile.py."""


@dataclass(frozen=True)
class FlashVariant:
    """One flash kernel: its source, templates and the config array it exports."""

    label: str
    """Its kernel spec (the registry's base name)."""
    source: Path
    """The .cu file (includes cuda/flash_split.cuh)."""
    main: str
    """Name expression of the main kernel; {mt}, {out}, {bug} (and {merge}, {xr}) are filled in."""
    config_symbol: str
    """extern "C" __constant__ int array holding the tile constants, in config_fields order."""
    config_fields: tuple[str, ...]
    """Names of that array's entries; SMEM_MT{mt} / THREADS_MT{mt} give each row tile's launch, SMEM_TRANSPOSED
    (where present) the all-transposed build's (RowLayout.TRANSPOSED: fewer KV stages, two CTAs to an SM)."""
    mts: tuple[int, ...]
    """Row tiles (m-tiles of 16 rows) it is instantiated for."""
    arch: str | None = None
    """Compile target when not the device's own (sm_90a: wgmma needs the arch-specific target)."""
    merges_in_kernel: bool = False
    """The main kernel takes {merge} (enum Merge): IN_KERNEL merges the splits itself on one-wave grids (no
    combine launch); WORK_TABLE (where tile_ns is set) walks a work table (kdtr/kernels/flash/schedule.py)."""
    kv_tensor_map: bool = False
    """The main kernel's second parameter is the cache's TMA tensor map (kdtr/kernels/flash/tma.py; box from the config)."""
    extra_rows: int = 0
    """Rows past 16 * mt the last row tile can take as transposed products (the {xr} template, enum RowLayout;
    the kernel's XR_MAX, a test keeps them equal); 0: none."""
    tile_ns: float = 0.0
    """Measured time of one KV tile of a 64-row CTA, ns: the work table's model (kdtr/kernels/flash/schedule.py);
    0: the kernel takes no work table."""

    def mts_for(self, rows: int) -> tuple[int, ...]:
        """Row tiles the plan weighs for ``rows`` query rows (plan.row_tile_choices where it is built for several)."""
        return row_tile_choices(rows) if len(self.mts) > 1 else self.mts

    def read_config(self, read_ints) -> dict:
        """The config array as {field: value}; ``read_ints(symbol, n)`` reads n ints of a global from
        a loaded module (FlashKernel.config, on a GPU) or from a cubin file (kdtr compile, anywhere)."""
        return dict(zip(self.config_fields, read_ints(self.config_symbol, len(self.config_fields))))

    @staticmethod
    def launch_shape(config: dict, mt: int, xr: int = RowLayout.TILES) -> tuple[int, int]:
        """(threads, dynamic shared memory bytes) of the main kernel on row tile ``mt`` and row layout ``xr``,
        from the build's config array."""
        transposed = xr == RowLayout.TRANSPOSED and "SMEM_TRANSPOSED" in config
        return config[f"THREADS_MT{mt}"], config["SMEM_TRANSPOSED" if transposed else f"SMEM_MT{mt}"]

    @staticmethod
    def bn(config: dict, mt: int) -> int:
        """Keys a KV tile of row tile ``mt``'s build (the split table's and the split ranges' unit)."""
        return config[f"BN_MT{mt}"]

    def dynamic_smem(self, name_expression: str, config: dict) -> int:
        """Dynamic shared memory a launch of kernel ``name_expression`` asks for (what FlashKernel.steps passes,
        unless a Force's occupancy pads it): the main kernel's on its row tile, the device scheduler's; 0 for the merges."""
        if name_expression == device_plan.SCHEDULE_KERNEL:
            return device_plan.SCHED_SMEM_BYTES
        head = self.main.split("<")[0] + "<"
        if not name_expression.startswith(head):
            return 0
        args = [a.strip() for a in name_expression[len(head):].rstrip(">").split(",")]
        mt = self.mts[0] if len(self.mts) == 1 else int(args[0])
        xr = int(args[-1]) if self.extra_rows else RowLayout.TILES
        return self.launch_shape(config, mt, xr)[1]


FLASH = FlashVariant(
    "flash", CUDA_DIR / "flash.cu", "kdtr_flash_verify<{mt}, {out}, {bug}>", "kdtr_flash_config",
    ("BN_MT1", "BN_MT2", "BN_MT4", "STAGES", "MAX_T", "SMEM_MT1", "SMEM_MT2", "SMEM_MT4", "THREADS_MT1", "THREADS_MT2", "THREADS_MT4",
     "COMBINE_THREADS", "COMBINE_MAX_CHUNKS", "COMBINE_ROWS_MAX_SPLITS", "NARROW_BATCH", "COMBINE_ROWS_BATCH"),
    (1, 2, 4))
FLASH_SM90 = FlashVariant(
    "flash-sm90", CUDA_DIR / "flash_sm90.cu", "kdtr_flash_sm90_verify<{out}, {bug}, {merge}, {xr}>",
    "kdtr_flash_sm90_config",
    ("BN_MT4", "STAGES", "MAX_T", "SMEM_MT4", "THREADS_MT4", "COMBINE_THREADS", "COMBINE_MAX_CHUNKS", "TMA_BOX_COLS",
     "TMA_BOX_SLABS", "COMBINE_ROWS_MAX_SPLITS", "WORK_INTS", "JOB_INTS", "NARROW_BATCH", "COMBINE_ROWS_BATCH",
     "SMEM_TRANSPOSED"), (4,),
    "sm_90a", merges_in_kernel=True, kv_tensor_map=True, extra_rows=int(RowLayout.EXTRA), tile_ns=1060.0)


class FlashKernel:
    """``flash`` / ``flash-sm90``: bf16 tensor-core verify + LSE combine (bf16 storage; any page size; T <= MAX_T)."""

    writes_lse = True

    def __init__(self, name: str, caps, bug: int = 0, variant: FlashVariant = FLASH, force: Force = Force(),
                 profile: bool = False):
        self.name, self.caps, self.bug, self.variant, self.force = name, caps, int(bug), variant, force
        self.profile = profile
        """Built with the loop-section counters (-DKDTR_PROFILE, cuda/profile.cuh): tools/profile.py."""
        self._fns: dict[str, object] = {}
        self._config: dict | None = None

    def _load(self, expr: str, dependent: bool = False):
        """The loaded kernel; the merges (by name), and ``dependent`` builds, are launched dependent on the step
        before them (kdtr/kernels/pdl.py)."""
        from kdtr.kernels.launch import load_function

        if expr not in self._fns:
            options = (f"-D{PROFILE_DEFINE}",) if self.profile else ()
            self._fns[expr] = load_function(self.variant.source, expr, arch=self.variant.arch, options=options,
                                            dependent=dependent or expr.startswith(DEPENDENT_PREFIX))
        return self._fns[expr]

    def _per_sm(self, expr: str, threads: int, dynamic_smem: int, limits: ArchLimits) -> int:
        """Resident CTAs an SM of ``limits`` of build ``expr`` launched with ``threads`` and ``dynamic_smem``."""
        registers, static_smem = _resources(self._load(expr))
        return occupancy(threads, registers, dynamic_smem + static_smem, limits)

    def config(self) -> dict:
        """The compiled module's config array: BN, smem bytes and threads per mt, STAGES, MAX_T..."""
        if self._config is None:
            from kdtr.kernels.launch import read_global_ints

            loaded = self._load(COMBINE.format(out="float"))
            self._config = self.variant.read_config(lambda symbol, n: read_global_ints(loaded.module, symbol, n))
        return self._config

    def steps(self, dp) -> tuple[list[Step], int, int]:
        """([Step], workspace_bytes, num_splits): the main kernel, then the split merge where there is one; for a
        work table, the device scheduler first. Planned from dp's shapes and capacity alone (Shape.of), never
        from its prefix lengths: what depends on those is decided on the device at every launch.

        Under ``force.occupancy`` (an arch of arch.EMULATED_ARCHS): planned with that arch's CTAs an SM (this
        GPU's SM count), and every launch asks for the dynamic shared memory that holds this GPU's residency to
        that arch's (plan.emulated_smem): ``flash[occupancy=sm_120]`` on an H200 runs as an sm_120 would hold it."""
        from kdtr.kernels.launch import device_info

        info = device_info()
        real = ArchLimits.of(info)
        if not self.force.occupancy:
            return self._steps(dp, info, real)
        emulated = EMULATED_ARCHS[self.force.occupancy]
        steps, workspace, splits = self._steps(dp, info, emulated)
        return [self._emulated(s, real, emulated) for s in steps], workspace, splits

    def _emulated(self, step: Step, real: ArchLimits, emulated: ArchLimits) -> Step:
        """``step`` asking for the dynamic shared memory that holds this GPU's residency to ``emulated``'s
        (plan.emulated_smem); ValueError, one line naming the kernel, where that cannot be done."""
        registers, static_smem = _resources(step.loaded)
        threads = step.block[0] * step.block[1] * step.block[2]
        try:
            _, smem = emulated_smem(threads, registers, static_smem, step.smem, real, emulated)
        except ValueError as e:
            raise ValueError(f"{self.name}: {next(iter(step.loaded.compiled.lowered))}: {e}") from None
        return replace(step, smem=smem)

    def _steps(self, dp, info: dict, limits: ArchLimits) -> tuple[list[Step], int, int]:
        """steps() planned with CTAs an SM of ``limits``."""
        from kdtr.kernels.launch import CTYPES

        pr, v, force = dp.problem, self.variant, self.force
        shape, bug = Shape.of(pr), kernel_bug(Bug(self.bug))
        out_t, cfg = CTYPES[dp.out_dtype], self.config()

        def resident(mt: int, xr: RowLayout) -> int:  # CTAs per SM of a build (the merges and work table keep its bounds)
            return self._per_sm(v.main.format(mt=mt, out=out_t, bug=bug, merge=0, xr=int(xr)), *v.launch_shape(cfg, mt, xr), limits)

        transposed = (v.extra_rows and force.xr is not False and force.merge is not Merge.IN_KERNEL
                      and 0 < shape.rows <= v.extra_rows)
        builds = [Build(mt, v.bn(cfg, mt), resident(mt, RowLayout.TILES), bug, v.merges_in_kernel, v.extra_rows,
                        resident(mt, RowLayout.TRANSPOSED) if transposed else 0, v.tile_ns)
                  for mt in ((force.mt,) if force.mt else v.mts_for(shape.rows))]
        device = Device(info["sm_count"], info["l2_bytes"])
        build, pl = choose_row_tile(shape, device, builds, force)
        mt = build.mt
        table = choose_work_table(shape, device, build, pl, force)
        if table is not None:
            return self._work_table_steps(dp, shape, pl, table.recipe, mt, out_t, cfg)
        splits = self._split_table(pl.model.table(shape.capacity))
        sched = self._sched(splits, build.bn)
        main = self._load(v.main.format(mt=mt, out=out_t, bug=bug, merge=int(pl.merge), xr=int(pl.xr)))
        threads, smem = v.launch_shape(cfg, mt, pl.xr)
        steps = [Step(main, pl.grid, (threads, 1, 1), smem, (*self._tensor_map_args(dp, cfg), sched), (splits,))]
        if pl.splits > 1 and pl.merge is not Merge.IN_KERNEL:
            name, grid, merge_threads = combine_launch(
                shape.rows, pr.B, pl.splits, info["sm_count"], cfg,
                lambda n, t: self._per_sm(n.format(out=out_t), t, 0, limits), force.combine)
            steps.append(Step(self._load(name.format(out=out_t)), grid, (merge_threads, 1, 1), 0, (sched,), (splits,)))
        return steps, pl.workspace_bytes(pr.T, pr.H), pl.splits

    @staticmethod
    def _split_table(table: np.ndarray):
        """The plan's split table on the device (uploaded once, when the launch is prepared)."""
        from kdtr.kernels.launch import device_ints

        return device_ints(table)

    def _sched(self, splits, bn: int, **work_table) -> np.ndarray:
        """The FlashSched argument: the split table (its last entry the capacity's) and, for a work table, the
        recipe and where its tables live in the workspace."""
        fields = dict(splits=splits.data.ptr, table_offset=device_plan.NO_TABLE, tiles_cap=splits.size - 1,
                      tile_shift=device_plan.tile_shift(bn), max_pieces=0, max_jobs=0, family=0, target=0,
                      interval=0, whole=0, row_tiles=0, rows_per_tile=0)
        return device_plan.pack(**{**fields, **work_table})

    def _work_table_steps(self, dp, shape: Shape, pl, recipe, mt: int, out_t: str, cfg: dict) -> tuple[list[Step], int, int]:
        """steps() for a work table: the device scheduler (one CTA) writes this launch's work and job tables into
        the workspace from the prefix lengths; the Merge.WORK_TABLE main kernel, launched dependent on it, runs one
        CTA a piece (the grid the recipe's most pieces, CTAs past this launch's exit); kdtr_flash_combine_jobs
        merges the cut jobs (CTAs past them exit). num_splits: the partial slots the workspace holds."""
        from kdtr.kernels.flash.schedule import JOB_FIELDS, WORK_FIELDS

        v, rows = self.variant, 16 * mt
        if (cfg["WORK_INTS"], cfg["JOB_INTS"]) != (len(WORK_FIELDS), len(JOB_FIELDS)):
            raise RuntimeError(f"{v.source.name}: work/job rows of {cfg['WORK_INTS']}/{cfg['JOB_INTS']} ints, "
                               f"kdtr/kernels/flash/schedule.py writes {len(WORK_FIELDS)}/{len(JOB_FIELDS)}")
        jobs = shape.B * pl.row_tiles
        bn = v.bn(cfg, mt)
        max_pieces = recipe.max_pieces(jobs, -(-shape.capacity // bn) + -(-shape.T // bn))
        partials = -(-max_pieces * rows * (DV + 1) * 4 // 16) * 16  # fp32 partial out and lse of every slot
        table_bytes = 4 * device_plan.table_ints(max_pieces, jobs, cfg["WORK_INTS"], cfg["JOB_INTS"])
        splits = self._split_table(np.ones(1, np.int32))  # unused by these builds; a valid table all the same
        sched = self._sched(splits, bn, table_offset=partials, max_pieces=max_pieces, max_jobs=jobs,
                            family=int(recipe.family), target=recipe.target, interval=recipe.interval,
                            whole=recipe.whole, row_tiles=pl.row_tiles, rows_per_tile=rows)
        bug = kernel_bug(Bug(self.bug))
        main = self._load(v.main.format(mt=mt, out=out_t, bug=bug, merge=int(Merge.WORK_TABLE), xr=int(RowLayout.TILES)),
                          dependent=True)
        threads, smem = v.launch_shape(cfg, mt)
        warps = cfg["COMBINE_THREADS"] // 32
        steps = [
            Step(self._load(device_plan.SCHEDULE_KERNEL), (1, 1, 1), (device_plan.SCHED_THREADS, 1, 1),
                 device_plan.SCHED_SMEM_BYTES, (sched,), (splits,)),
            Step(main, (max_pieces, 1, 1), (threads, 1, 1), smem, (*self._tensor_map_args(dp, cfg), sched), (splits,)),
            Step(self._load(COMBINE_JOBS.format(out=out_t, rows=rows)), (-(-rows // warps), jobs, 1),
                 (cfg["COMBINE_THREADS"], 1, 1), 0, (sched,), (splits,)),
        ]
        return steps, partials + table_bytes, max_pieces

    def _tensor_map_args(self, dp, cfg) -> tuple:
        """The main kernel's arguments after KdtrParams: the cache's tensor map where it takes one.
        Encoded for every page size; the kernel uses it only where a tile lies in one page."""
        if not self.variant.kv_tensor_map:
            return ()
        from kdtr.kernels.flash import tma

        pages, page_size = dp.problem.kv_cache.shape[0], dp.problem.page_size
        spec = tma.kv_map_spec(pages, page_size, DK, cfg["TMA_BOX_COLS"], cfg["BN_MT4"], cfg["TMA_BOX_SLABS"])
        return (tma.encode(spec, dp.kv_cache.data.ptr),)

    @property
    def baked_lengths(self) -> bool:
        """The planted baked-lengths bug: a launch bug, on the correct builds."""
        return self.bug == Bug.BAKED_LENGTHS

    def run(self, problem, out_dtype: str):
        from kdtr.kernels.launch import DeviceProblem

        return self.run_on(DeviceProblem(problem, out_dtype))

    def run_on(self, dp):
        from kdtr.kernels.launch import launch_kernels

        return launch_kernels(self.name, dp, *self.steps(dp), baked_lengths=self.baked_lengths)

    def prepare(self, dp, workspace=None):
        """A launcher on dp: everything decided and packed here, from shapes; the call only enqueues (graph-safe).
        ``workspace``: a zero-filled buffer of the steps' workspace bytes to use (one for every layer)."""
        from kdtr.kernels.launch import make_launcher

        return make_launcher(dp, *self.steps(dp), workspace=workspace, baked_lengths=self.baked_lengths)

    def graph(self, problem, out_dtype: str):
        """Prepared on buffers holding ``problem`` and captured into a CUDA graph (kdtr verify --graph)."""
        from kdtr.kernels.launch import capture_kernel

        return capture_kernel(self, problem, out_dtype)


def _resources(loaded) -> tuple[int, int]:
    """(registers a thread, static shared memory bytes) of a loaded build, from ptxas's report (255 and 0 where
    the report is missing)."""
    res = next(iter(loaded.compiled.resources.values()), None)
    return (res.registers, res.shared_bytes) if res else (255, 0)


def profile_build(kernel: FlashKernel) -> FlashKernel:
    """``kernel`` (its force and planted bug kept) built with the loop-section counters of cuda/profile.cuh:
    the one compile switch, for tools/profile.py; its main steps' modules hold ``kdtr_profile``."""
    return FlashKernel(f"{kernel.name} (profile)", kernel.caps, kernel.bug, kernel.variant, kernel.force, profile=True)
