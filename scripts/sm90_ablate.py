"""Time flash-sm90 built with its -D experiment knobs (cuda/flash_sm90.cu) on a compute and a
memory shape, next to the default build: today the KV pipeline depth (3-4 stages: above the
99 KB the default keeps). Earlier knobs (L2 prefetch, S-first order, early block-table read,
producer arrive at "P full") were measured this way, then removed or adopted (docs/PERF.md).
A timing aid for docs/PERF.md: nothing here is checked (`scripts/gpu_check.sh ablate` runs
scripts/sm90_debug.py on the same builds first).

    python3 scripts/sm90_ablate.py [LABEL=OPTS ...]   e.g. s3="-DKDTR_F90_STAGES=3 -DKDTR_F90_EXPERIMENT"
"""
import sys

from kdtr import bench, flash, kernels
from kdtr.timing import measure_peaks

DEFAULT = {
    "base": "",
    "stages3": "-DKDTR_F90_STAGES=3 -DKDTR_F90_EXPERIMENT",
    "stages4": "-DKDTR_F90_STAGES=4 -DKDTR_F90_EXPERIMENT",
}
variants = dict(a.split("=", 1) for a in sys.argv[1:]) or DEFAULT
impls = [flash.FlashKernel(label, kernels.FLASH90_CAPS, 0, flash.SM90, tuple(o.split())) for label, o in variants.items()]
specs = (bench.grid(["deepseek-v3"], [8], [64], [8192], [1]) + bench.grid(["deepseek-v3"], [8], [256], [32768], [1])
         + bench.grid(["kimi-k2"], [8], [0, 8], [32768], [32]) + bench.grid(["kimi-k2"], [8], [0, 8], [32768, 131072], [1]))
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
