"""Time flash-sm90 built with its -D experiment knobs (cuda/flash_sm90.cu) on a compute and a
memory shape, next to the default build: today the KV pipeline depth (3-4 stages: above the
99 KB the default keeps). Earlier knobs (L2 prefetch, S-first order, early block-table read,
producer arrive at "P full", the fused softmax, an early "tile landed", S in two 16-key halves)
were measured this way, then removed or adopted (docs/PERF.md). A timing aid for docs/PERF.md:
nothing here is checked (`scripts/gpu_check.sh ablate` runs scripts/sm90_debug.py on the same
builds first, `knobs` scripts/knob_verify.py).

    python3 scripts/sm90_ablate.py [SHAPES] [--apart] [LABEL=OPTS ...]   e.g. s3="-DKDTR_F90_STAGES=3 -DKDTR_F90_EXPERIMENT"

--apart times each build in a process of its own (twice, the second time in reverse order): within one process the
first build timed is not on equal terms with the others on Kimi decode (docs/PERF.md, session 20; session 21 found
it is neither where the code nor where the inputs land).

OPTS may also hold kdtr/kernels/knobs.py variables (NAME=VALUE words, e.g. s48="KDTR_FLASH_SPLITS=48"): they are
set only while that variant's launch is planned, so one process times the plan's choice beside forced ones.

SHAPES: "default" (a compute and a memory mix), "balance" (the one-wave shapes whose last split
also walks the tree tail: B1 decode and the small compute shapes), "decode" (Kimi B1 only) or "xr"
(Kimi T9, whose 72 rows take the transposed-rows build, and a few shapes that do not), "tail" (Kimi requests of 64 k + 8 rows: T9 and T17, where the rows past 64 k run as a second launch), "xonly" (Kimi decode,
whose 8 rows are all transposed (XR_ONLY) where forced or where the 64-row plan takes several waves), "xrmodel" (T9
batches where the plan's model takes them and nothing had timed them), "segments" (the DeepSeek T65
shapes where kdtr/kernels/flash/schedule.py's work table replaces uniform splits, and a few it leaves), "recheck" (the
shapes a sweep moved by more than noise: an older tree against this one).
Run with PYTHONPATH set to an exported older tree to time that tree's kernel on the same machine
(gpu_check.sh abtree).
"""
import contextlib
import os
import subprocess
import sys

from kdtr.bench import run as bench
from kdtr.kernels import registry as kernels
from kdtr.inputs.presets import BENCH_GRIDS
from kdtr.bench.timing import measure_peaks

DEFAULT = {
    "base": "",
    "stages3": "-DKDTR_F90_STAGES=3 -DKDTR_F90_EXPERIMENT",
    "stages4": "-DKDTR_F90_STAGES=4 -DKDTR_F90_EXPERIMENT",
}
SHAPES = {
    "default": (bench.grid(["deepseek-v3"], [8], [64], [8192], [1]) + bench.grid(["deepseek-v3"], [8], [256], [32768], [1])
                + bench.grid(["kimi-k2"], [8], [0, 8], [32768], [32]) + bench.grid(["kimi-k2"], [8], [0, 8], [32768, 131072], [1])),
    "tail": bench.grid(["kimi-k2"], [8], [8], [32768, 131072], [1]) + bench.grid(["kimi-k2"], [8], [8, 16], [32768], [2])
            + bench.grid(["kimi-k2"], [8], [16], [32768], [1]),
    "xonly": bench.grid(["kimi-k2"], [8], [0], [32768], [1, 32]) + bench.grid(["kimi-k2"], [8], [0], [131072], [1, 8, 16, 32]),
    "balance": (bench.grid(["kimi-k2"], [8], [0, 4, 8], [32768, 131072], [1]) + bench.grid(["kimi-k2"], [8], [0], [32768], [32])
                + bench.grid(["deepseek-v3"], [8], [64], [8192], [1, 8]) + bench.grid(["deepseek-v3"], [8], [64], [32768], [1])
                + bench.grid(["deepseek-v3"], [8], [256], [8192], [1])),
    "decode": bench.grid(["kimi-k2"], [8], [0, 4, 8], [32768, 131072], [1]),
    "t9": bench.grid(["kimi-k2"], [8], [8], [32768, 131072], [1]),
    "t1batch": bench.grid(["kimi-k2"], [8], [0], [32768, 131072], [1, 2, 4]),  # one-wave Kimi decode batches
    "t1narrow": bench.grid(["kimi-k2"], [8], [0], [32768, 131072], [1, 2]),  # where the narrow combine runs
    # the merge-launch width on 16-80 rows of Kimi decode (session 16: 64-column narrow chunks took T5 B1 1.1-1.7 us faster)
    "rows16to80": (bench.grid(["kimi-k2"], [8], [4], [32768, 131072], [1, 2]) + bench.grid(["kimi-k2"], [8], [8], [32768, 131072], [1])
                   + bench.grid(["kimi-k2"], [8], [0], [32768, 131072], [2, 4])),
    "t15": bench.grid(["kimi-k2"], [8], [0, 4], [32768, 131072], [1]),
    "t1b8": bench.grid(["kimi-k2"], [8], [0], [32768, 131072], [8]),  # 64 rows a launch: the 64-column merge by the rule
    # the warp-per-row merge by halves (session 17): the DeepSeek T65 launches past 4 splits, and T257 P8k B1 (2 splits)
    "rowsparts": (bench.grid(["deepseek-v3"], [8], [64], [8192, 131072], [1]) + bench.grid(["deepseek-v3"], [8], [64], [131072], [8])
                  + bench.grid(["deepseek-v3"], [8], [256], [8192], [1])),
    # the narrow merge's warps (session 17): every Kimi decode launch of 8-80 rows, and T9 B2 (144 rows)
    "narrowwarps": (bench.grid(["kimi-k2"], [8], [0], [32768, 131072], [1, 2, 4, 8]) + bench.grid(["kimi-k2"], [8], [4], [32768, 131072], [1, 2])
                    + bench.grid(["kimi-k2"], [8], [8], [32768, 131072], [1, 2])),
    # one-wave launches whose prologue session 18 changed (branch wip/bt-hint, not kept): XR_ONLY's Kimi T1 launches,
    # the 64-row decode and DeepSeek T65 P8k B1
    "hint": (bench.grid(["kimi-k2"], [8], [0], [32768, 131072], [1, 2, 4]) + bench.grid(["kimi-k2"], [8], [4, 8], [32768, 131072], [1])
             + bench.grid(["deepseek-v3"], [8], [64], [8192], [1])),
    # the cache map's L2 promotion (session 18): every memory-bound shape, and compute-bound ones of each size
    "promotion": (bench.grid(["kimi-k2"], [8], [0, 4, 8], [32768, 131072], [1, 32])
                  + bench.grid(["deepseek-v3"], [8], [64], [8192, 131072], [1, 8]) + bench.grid(["deepseek-v3"], [8], [256], [32768], [1])),
    # S(i+1) ahead of P V(i), at 2 and 3 stages (session 19): the 64-row builds' tile chain (decode and compute), XR and XR_ONLY
    "sfirst": (bench.grid(["kimi-k2"], [8], [0, 4, 8], [32768, 131072], [1]) + bench.grid(["kimi-k2"], [8], [0, 4, 8], [32768], [32])
               + bench.grid(["deepseek-v3"], [8], [64], [8192], [1, 8]) + bench.grid(["deepseek-v3"], [8], [256], [8192, 32768], [1])),
    # the whole sweep (kdtr/inputs/presets.py BENCH_GRIDS): what a build does to every target at once
    "sweep": bench.grid(**BENCH_GRIDS["compute"]) + bench.grid(**BENCH_GRIDS["memory"]),
    # the prologue's Q load (session 19): the 64-row B1 launches whose prologue is a large part
    "qload": (bench.grid(["kimi-k2"], [8], [4, 8], [32768, 131072], [1]) + bench.grid(["deepseek-v3"], [8], [64], [8192, 32768], [1])),
    # the splits' partials round trip (session 20: bf16 partials on branch wip/partials-as-out, the row stores, the
    # no-op builds): the split launches where it is a large part (B1 decode, the small compute shapes) and a batch
    "partials": (bench.grid(["kimi-k2"], [8], [0, 4, 8], [32768, 131072], [1]) + bench.grid(["kimi-k2"], [8], [8], [32768], [32])
                 + bench.grid(["deepseek-v3"], [8], [64], [8192, 32768], [1]) + bench.grid(["deepseek-v3"], [8], [64], [8192], [8])
                 + bench.grid(["deepseek-v3"], [8], [256], [8192], [1])),
    "recheck": (bench.grid(["deepseek-v3"], [8], [64], [131072], [8]) + bench.grid(["deepseek-v3"], [8], [256, 512], [32768], [8])
                + bench.grid(["deepseek-v3"], [8], [64], [32768], [1])
                + bench.grid(["kimi-k2"], [8], [0, 4], [32768], [1])),
    "segments": (bench.grid(["deepseek-v3"], [8], [64], [8192, 32768, 131072], [1, 8]) + bench.grid(["deepseek-v3"], [8], [256], [8192], [1, 8])
                 + bench.grid(["deepseek-v3"], [8], [256], [32768], [1])
                 + bench.grid(["deepseek-v3"], [8], [512], [8192], [8]) + bench.grid(["kimi-k2"], [8], [0], [32768], [32])),
    "xrmodel": bench.grid(["kimi-k2"], [8], [8], [131072], [4, 8]) + bench.grid(["kimi-k2"], [8], [8], [32768], [16]),
    "xr": (bench.grid(["kimi-k2"], [8], [8], [32768, 131072], [1, 32]) + bench.grid(["kimi-k2"], [8], [8], [32768], [4, 8]) + bench.grid(["kimi-k2"], [8], [0], [32768], [1, 32])
           + bench.grid(["kimi-k2"], [8], [4], [131072], [1]) + bench.grid(["deepseek-v3"], [8], [64], [8192], [1, 8])
           + bench.grid(["deepseek-v3"], [8], [256], [32768], [1])),
}
shape_set = next((a for a in sys.argv[1:] if "=" not in a and not a.startswith("--")), "default")
variants = dict(a.split("=", 1) for a in sys.argv[1:] if "=" in a) or DEFAULT


def apart() -> None:
    """--apart: each build timed in a process of its own, in list order and then reversed. In one process the
    build loaded first times 1-2 us apart from byte-identical builds loaded after it on Kimi decode (docs/PERF.md,
    session 20); here each build is its process's first. Code and input placement do not move it (session 21:
    84 module loads and 16 input placements, one state)."""
    times: dict[tuple[str, str], list[float]] = {}
    shapes: list[str] = []
    for order in (list(variants.items()), list(variants.items())[::-1]):
        for label, opts in order:
            out = subprocess.run([sys.executable, __file__, shape_set, f"{label}={opts}"], capture_output=True, text=True,
                                 check=True).stdout
            shape = ""
            for line in out.splitlines():
                if ": floor" in line and not line.startswith(" "):
                    shape = line.split(":")[0]
                    shapes += [shape] if shape not in shapes else []
                elif shape and line.split()[:1] == [label] and line.split()[2:3] == ["us"]:
                    times.setdefault((shape, label), []).append(float(line.split()[1]))
    print("each build in its own process; us in list order / reversed order")
    for shape in shapes:
        print(shape)
        for label in variants:
            print(f"  {label:16s} " + " / ".join(f"{t:.1f}" for t in times.get((shape, label), [])))


if "--apart" in sys.argv:
    apart()
    sys.exit(0)


class WithKnobs:
    """A flash-sm90 build whose launches are planned under some KDTR_* knob values (kdtr/kernels/knobs.py)."""

    def __init__(self, kernel, knobs: dict):
        self.kernel, self.knobs = kernel, knobs

    def __getattr__(self, name):
        return getattr(self.kernel, name)

    @contextlib.contextmanager
    def _env(self):
        old = {k: os.environ.get(k) for k in self.knobs}
        os.environ.update(self.knobs)
        try:
            yield
        finally:
            for k, v in old.items():
                os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)

    def run_on(self, dp):
        with self._env():
            return self.kernel.run_on(dp)

    def prepare(self, dp):
        with self._env():
            return self.kernel.prepare(dp)


def build(label: str, opts: str):
    words = opts.split()
    knobs = dict(w.split("=", 1) for w in words if w.startswith("KDTR_"))
    kernel = kernels.flash90_build(label, " ".join(w for w in words if not w.startswith("KDTR_")))
    return WithKnobs(kernel, knobs) if knobs else kernel


impls = [build(label, o) for label, o in variants.items()]
specs = SHAPES[shape_set]
peaks = measure_peaks()
print(f"peaks: copy {peaks['copy_gbs']:.0f} GB/s, gemm {peaks['gemm_tflops']:.0f} TFLOP/s")
for spec in specs:
    row = bench.bench_shape(spec, impls, peaks, check=False)
    print(f"{spec.name}: floor {row.roofline_ms * 1e3:.1f} us ({row.bound})")
    for c in row.cells:
        if c.median_ms:
            print(f"  {c.impl:16s} {c.median_ms * 1e3:9.1f} us {c.tflops:7.1f} TF {c.gbs:6.0f} GB/s {c.pct_roofline:6.1%}")
        else:
            print(f"  {c.impl:16s} {c.status[:100]}")
