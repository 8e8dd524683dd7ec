"""The flash kernels and their one-, two- or three-launch run.

Two kernels share the operator, the split plan, the workspace and the merge
(cuda/flash_split.cuh): ``flash`` (cuda/flash.cu, mma.sync: sm_80, sm_90, sm_120) and
``flash-sm90`` (cuda/flash_sm90.cu, wgmma: sm_90a only). Each is a FlashVariant below; FlashKernel
loads the builds that kdtr/kernels/flash/plan.py's plan names and lists their launches (the main kernel, a
tail launch, the split merge, dependent on the one before where the device allows: kdtr/kernels/pdl.py).
Tile constants come from the compiled module (its ``*_config`` array), never restated here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kdtr.kernels.flash.plan import (COMBINE, COMBINE_JOBS, XR_ONLY, choose_segments, combine_launch, occupancy, plan,
                              row_tile_m)
from kdtr.kernels.knobs import FlashKnobs
from kdtr.kernels.nvrtc import CUDA_DIR
from kdtr.inputs.presets import DK

DEPENDENT_PREFIX = "kdtr_flash_combine"
"""The merge kernels open with kdtr::pdl_wait(): launched after the main kernel, they are launched
dependent on it (kdtr/kernels/pdl.py; tests/test_pdl.py checks each kernel so named waits first)."""


@dataclass(frozen=True)
class FlashVariant:
    """One flash kernel: its source, templates and the config array it exports."""

    source: Path
    """The .cu file (includes cuda/flash_split.cuh)."""
    main: str
    """Name expression of the main kernel; {mt}, {out}, {bug} (and {merge}, {xr}) are filled in."""
    config_symbol: str
    """extern "C" __constant__ int array holding the tile constants, in config_fields order."""
    config_fields: tuple[str, ...]
    """Names of that array's entries; SMEM_MT{mt} / THREADS_MT{mt} give each row tile's launch."""
    mts: tuple[int, ...]
    """Row tiles (m-tiles of 16 rows) it is instantiated for."""
    arch: str | None = None
    """Compile target when not the device's own (sm_90a: wgmma needs the arch-specific target)."""
    merges_in_kernel: bool = False
    """The main kernel takes {merge}: 1 merges the splits itself on one-wave grids (no combine launch);
    2 (where tile_ns is set) walks a work table of segments (kdtr/kernels/flash/schedule.py)."""
    kv_tensor_map: bool = False
    """The main kernel's second parameter is the cache's TMA tensor map (kdtr/kernels/flash/tma.py; box from the config)."""
    extra_rows: int = 0
    """Rows past 16 * mt the last row tile can take as transposed products (the {xr} template; the
    kernel's XR_MAX, a test keeps them equal); 0: none."""
    tile_ns: float = 0.0
    """Measured time of one KV tile of a 64-row CTA, ns: the segments' model (kdtr/kernels/flash/schedule.py); 0: the
    kernel takes no work table."""

    def mt_for(self, rows: int) -> int:
        return row_tile_m(rows) if len(self.mts) > 1 else self.mts[0]

    def read_config(self, read_ints) -> dict:
        """The config array as {field: value}; ``read_ints(symbol, n)`` reads n ints of a global from
        a loaded module (FlashKernel.config, on a GPU) or from a cubin file (kdtr compile, anywhere)."""
        return dict(zip(self.config_fields, read_ints(self.config_symbol, len(self.config_fields))))

    @staticmethod
    def launch_shape(config: dict, mt: int) -> tuple[int, int]:
        """(threads, dynamic shared memory bytes) of the main kernel on row tile ``mt``, from the
        build's config array."""
        return config[f"THREADS_MT{mt}"], config[f"SMEM_MT{mt}"]

    def dynamic_smem(self, name_expression: str, config: dict) -> int:
        """Dynamic shared memory a launch of kernel ``name_expression`` asks for (what
        FlashKernel.steps passes): the main kernel's on its row tile; 0 for the merges."""
        head = self.main.split("<")[0] + "<"
        if not name_expression.startswith(head):
            return 0
        mt = self.mts[0] if len(self.mts) == 1 else int(name_expression[len(head):].split(",")[0])
        return self.launch_shape(config, mt)[1]


MMA = FlashVariant(
    CUDA_DIR / "flash.cu", "kdtr_flash_verify<{mt}, {out}, {bug}>", "kdtr_flash_config",
    ("BN", "STAGES", "MAX_T", "SMEM_MT1", "SMEM_MT2", "SMEM_MT4", "THREADS_MT1", "THREADS_MT2", "THREADS_MT4",
     "COMBINE_THREADS", "COMBINE_MAX_CHUNKS", "COMBINE_ROWS_MAX_SPLITS", "NARROW_BATCH", "COMBINE_ROWS_BATCH"),
    (1, 2, 4))
SM90 = FlashVariant(
    CUDA_DIR / "flash_sm90.cu", "kdtr_flash90_verify<{out}, {bug}, {merge}, {xr}>", "kdtr_flash90_config",
    ("BN", "STAGES", "MAX_T", "SMEM_MT4", "THREADS_MT4", "COMBINE_THREADS", "COMBINE_MAX_CHUNKS", "TMA_BOX_COLS",
     "TMA_BOX_SLABS", "COMBINE_ROWS_MAX_SPLITS", "WORK_INTS", "JOB_INTS", "NARROW_BATCH", "COMBINE_ROWS_BATCH"), (4,),
    "sm_90a", merges_in_kernel=True, kv_tensor_map=True, extra_rows=8, tile_ns=1060.0)

class FlashKernel:
    """``flash`` / ``flash-sm90``: bf16 tensor-core verify + LSE combine (bf16 storage; any page size; T <= MAX_T)."""

    writes_lse = True

    def __init__(self, name: str, caps, bug: int = 0, variant: FlashVariant = MMA, options: tuple[str, ...] = ()):
        self.name, self.caps, self.bug, self.variant = name, caps, int(bug), variant
        self.options = tuple(options)
        """Extra NVRTC options, e.g. the -D experiment knobs of cuda/flash_sm90.cu (docs/PERF.md)."""
        self._fns: dict[tuple[str, bool], object] = {}
        self._config: dict | None = None

    def _load(self, expr: str, dependent: bool | None = None):
        """The loaded kernel; ``dependent`` (default: the merges, by name) launches it dependent on the step
        before it (kdtr/kernels/pdl.py)."""
        from kdtr.kernels.launch import load_function

        dependent = expr.startswith(DEPENDENT_PREFIX) if dependent is None else dependent
        if (expr, dependent) not in self._fns:
            self._fns[expr, dependent] = load_function(self.variant.source, expr, arch=self.variant.arch,
                                                       options=self.options, dependent=dependent)
        return self._fns[expr, dependent]

    def _per_sm(self, expr: str, threads: int, dynamic_smem: int, info: dict) -> int:
        """Resident CTAs an SM of build ``expr`` launched with ``threads`` and ``dynamic_smem``: ptxas's
        registers and static shared memory for it (255 registers where the report is missing)."""
        res = next(iter(self._load(expr).compiled.resources.values()), None)
        return occupancy(threads, res.registers if res else 255, dynamic_smem + (res.shared_bytes if res else 0),
                         info["regs_per_sm"], info["smem_per_sm"])

    def config(self) -> dict:
        """The compiled module's config array: BN, STAGES, MAX_T, smem bytes and threads per mt..."""
        if self._config is None:
            from kdtr.kernels.launch import read_global_ints

            v = self.variant
            loaded = self._load(COMBINE.format(out="float"))
            self._config = v.read_config(lambda symbol, n: read_global_ints(loaded.module, symbol, n))
        return self._config

    def steps(self, dp):
        """([(Loaded, grid, block, smem[, extra args])], workspace_bytes, num_splits): main kernel (+ combine).

        The experiment knobs (kdtr/kernels/knobs.py: KDTR_FLASH_MT, _SPLITS, _MERGE, _COMBINE, _XR, _TAIL, _SEGMENTS)
        force one side of each choice below; KDTR_PDL=0 launches the combine plainly (kdtr/kernels/launch.py)."""
        from kdtr.kernels.launch import CTYPES, device_info, device_ints

        pr, info, v, kn = dp.problem, device_info(), self.variant, FlashKnobs.from_env()
        rows = pr.T * pr.H
        mt = kn.mt if kn.mt in v.mts else v.mt_for(rows)
        out_t, cfg = CTYPES[dp.out_dtype], self.config()
        threads, smem = v.launch_shape(cfg, mt)

        def resident(xr: int) -> int:  # CTAs per SM of a build (merge and segments keep the launch bounds)
            return self._per_sm(v.main.format(mt=mt, out=out_t, bug=self.bug, merge=0, xr=xr), threads, smem, info)

        per_sm = resident(0)
        # XR_ONLY: a request of <= 8 rows, or the tail launch of 64 k + 1..8 rows
        x_only = resident(XR_ONLY) if v.extra_rows and kn.xr != "0" and (0 < rows <= v.extra_rows or kn.tail == "1") else 0
        can_merge = v.merges_in_kernel and kn.merge_units > 0
        pl = plan(pr.B, pr.T, pr.H, int(pr.prefix_lens.max()), info["sm_count"], cfg["BN"], self.bug, mt, per_sm,
                  kn.splits or None, can_merge, v.extra_rows if kn.xr != "0" else 0, kn.xr == "1", kn.merge_units,
                  x_only, kn.tail)
        seg = choose_segments(pr.prefix_lens, pr.T, pr.H, pl, info["sm_count"] * per_sm, cfg["BN"], v.tile_ns,
                              self.bug, kn.segments, info["l2_bytes"], bool(kn.splits))
        if seg is not None:
            return self._segment_steps(dp, seg, mt, out_t, cfg)
        main = self._load(v.main.format(mt=mt, out=out_t, bug=self.bug, merge=int(pl.merge), xr=pl.xr))
        no_work = (device_ints(np.zeros(0, np.int32)),) if v.tile_ns else ()
        steps = [(main, pl.grid, (threads, 1, 1), smem, (*self._tensor_map_args(dp, cfg), *no_work))]
        if pl.tail:  # beside the row tiles' launch: dependent, so it starts at once (it waits only at its end)
            tail_fn = self._load(v.main.format(mt=mt, out=out_t, bug=self.bug, merge=0, xr=XR_ONLY), dependent=True)
            steps.append((tail_fn, (1, pl.splits, pr.B), (threads, 1, 1), smem, steps[0][4]))
        if pl.splits > 1 and not pl.merge:
            name, grid, merge_threads = combine_launch(
                rows, pr.B, pl.splits, info["sm_count"], cfg, lambda n, t: self._per_sm(n.format(out=out_t), t, 0, info),
                kn.combine)
            steps.append((self._load(name.format(out=out_t)), grid, (merge_threads, 1, 1), 0))
        return steps, pl.workspace_bytes(pr.T, pr.H), pl.splits

    def _segment_steps(self, dp, seg, mt: int, out_t: str, cfg: dict):
        """steps() for segments: the MERGE = 2 main kernel over the work table (one CTA a piece), then
        kdtr_flash_combine_jobs over the cut jobs if any; num_splits carries the partial slots."""
        from kdtr.kernels.launch import device_ints
        from kdtr.kernels.flash.schedule import JOB_FIELDS, WORK_FIELDS

        v, rows = self.variant, 16 * mt
        if (cfg["WORK_INTS"], cfg["JOB_INTS"]) != (len(WORK_FIELDS), len(JOB_FIELDS)):
            raise RuntimeError(f"{v.source.name}: work/job rows of {cfg['WORK_INTS']}/{cfg['JOB_INTS']} ints, "
                               f"kdtr/kernels/flash/schedule.py writes {len(WORK_FIELDS)}/{len(JOB_FIELDS)}")
        main = self._load(v.main.format(mt=mt, out=out_t, bug=self.bug, merge=2, xr=0))
        work, jobs = seg.tables(dp.problem.prefix_lens, cfg["BN"], rows)
        threads, smem = v.launch_shape(cfg, mt)
        steps = [(main, (len(work), 1, 1), (threads, 1, 1), smem, (*self._tensor_map_args(dp, cfg), device_ints(work)))]
        if len(jobs):
            warps = cfg["COMBINE_THREADS"] // 32
            steps.append((self._load(COMBINE_JOBS.format(out=out_t, rows=rows)), (-(-rows // warps), len(jobs), 1),
                          (cfg["COMBINE_THREADS"], 1, 1), 0, (device_ints(jobs),)))
        return steps, seg.workspace_bytes(rows), max(1, seg.slots)

    def _tensor_map_args(self, dp, cfg) -> tuple:
        """The main kernel's arguments after KdtrParams: the cache's tensor map where it takes one.
        Encoded for every page size; the kernel uses it only where a tile lies in one page."""
        if not self.variant.kv_tensor_map:
            return ()
        from kdtr.kernels.flash import tma

        pages, page_size = dp.problem.kv_cache.shape[0], dp.problem.page_size
        spec = tma.kv_map_spec(pages, page_size, DK, cfg["TMA_BOX_COLS"], cfg["BN"], cfg["TMA_BOX_SLABS"])
        return (tma.encode(spec, dp.kv_cache.data.ptr, tma.l2_promotion(FlashKnobs.from_env().tma_promotion)),)

    def run(self, problem, out_dtype: str):
        from kdtr.kernels.launch import DeviceProblem

        return self.run_on(DeviceProblem(problem, out_dtype))

    def run_on(self, dp):
        from kdtr.kernels.launch import launch_kernels

        return launch_kernels(self.name, dp, *self.steps(dp))

    def prepare(self, dp):
        from kdtr.kernels.launch import make_launcher

        return make_launcher(dp, *self.steps(dp))
