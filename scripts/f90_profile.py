"""Where flash-sm90's main loop spends its cycles: the kernel built with -DKDTR_F90_PROFILE sums,
per warpgroup role, the clock64 cycles of each loop section over every CTA (cuda/flash_sm90.cu,
struct Laps). Printed as cycles per KV tile, next to the tensor-pipe work of a tile measured by
scripts/wgmma_probe.py. A timing aid for docs/PERF.md: nothing here is checked.

    python3 scripts/f90_profile.py [default|small] [LABEL=OPTS ...]   (the plain build unless knobs are given)

"small": the compute shapes with few tiles per CTA, "decode": Kimi B1, "xr": Kimi T9 (transposed rows) and T1; the per-CTA lines (prologue
and its steps, epilogue, whole CTA in cycles and us) say how much lies outside the loop.
"""
import sys

from kdtr import bench, kernels
from kdtr.cases import build_problem
from kdtr.launch import DeviceProblem, _cupy, make_launcher

cp = _cupy()
PRODUCER = ("tile wait", "S issue", "S wait+softmax", "P store", "P-full wait")
CONSUMER = ("P-full wait", "alpha+P V issue", "P V wait", "both-consumer bar", "refill+commit")
SETS = {
    "default": (bench.grid(["deepseek-v3"], [8], [256], [32768], [1]) + bench.grid(["deepseek-v3"], [8], [64], [8192], [1])
                + bench.grid(["kimi-k2"], [8], [0], [32768], [32, 1]) + bench.grid(["kimi-k2"], [8], [8], [32768], [32])),
    "decode": bench.grid(["kimi-k2"], [8], [0, 4, 8], [32768], [1]),
    "xr": bench.grid(["kimi-k2"], [8], [8], [32768], [32, 1]) + bench.grid(["kimi-k2"], [8], [0], [32768], [32]),
    "small": (bench.grid(["deepseek-v3"], [8], [64], [8192], [1, 8]) + bench.grid(["deepseek-v3"], [8], [64], [32768], [1])
              + bench.grid(["deepseek-v3"], [8], [256], [8192], [1]) + bench.grid(["deepseek-v3"], [8], [256], [32768], [1])),
}
specs = SETS[next((a for a in sys.argv[1:] if "=" not in a), "default")]
variants = dict(a.split("=", 1) for a in sys.argv[1:] if "=" in a) or {"base": ""}
for label, opts in variants.items():
    kernel = kernels.flash90_build(label, "-DKDTR_F90_PROFILE " + opts)
    for spec in specs:
        layout, _ = build_problem(spec, values=False)
        dp = DeviceProblem(layout, spec.out_dtype)
        dp.randomize(0)
        steps, ws, splits = kernel.steps(dp)
        go = make_launcher(dp, steps, ws, splits)
        go()  # warm-up: clocks, caches
        main = steps[0][0]  # the main kernel's module holds the counters (the combine's has its own)
        prof = cp.ndarray((24,), cp.uint64, main.module.get_global("kdtr_f90_prof"))
        prof[:] = 0
        go()
        cp.cuda.runtime.deviceSynchronize()
        v = prof.get().astype(float)
        tiles, ctas = v[10], v[11]
        print(f"{label} {spec.name}: {int(ctas)} CTAs, {tiles / ctas:.1f} tiles each; cycles per tile:")
        print("  producer  " + "  ".join(f"{n} {v[i] / tiles:6.0f}" for i, n in enumerate(PRODUCER))
              + f"  | sum {v[0:5].sum() / tiles:6.0f}")
        print("  consumer  " + "  ".join(f"{n} {v[5 + i] / tiles:6.0f}" for i, n in enumerate(CONSUMER))
              + f"  | sum {v[5:10].sum() / tiles:6.0f}")
        loop = v[5:10].sum() / ctas
        print(f"  per CTA: prologue {v[12] / ctas:7.0f}  loop {loop:8.0f}  epilogue {v[13] / ctas:7.0f}  "
              f"whole {v[14] / ctas:8.0f} cycles = {v[15] / ctas / 1e3:6.1f} us  (SM clock {v[14] / v[15]:.2f} GHz)")
        print(f"  producer from entry: split known {v[16] / ctas:6.0f}  tail scan done {v[17] / ctas:6.0f}  "
              f"Q registers loaded {v[18] / ctas:6.0f}  first tile may start {v[12] / ctas:6.0f} cycles")
