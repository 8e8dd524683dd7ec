"""Where flash-sm90's main loop spends its cycles: the kernel built with -DKDTR_F90_PROFILE sums,
per warpgroup role, the clock64 cycles of each loop section over every CTA (cuda/flash_sm90.cu,
struct Laps). Printed as cycles per KV tile, next to the tensor-pipe work of a tile measured by
scripts/wgmma_probe.py. A timing aid for docs/PERF.md: nothing here is checked.

    python3 scripts/f90_profile.py [LABEL=OPTS ...]     (default: the plain build; OPTS are more -D knobs)
"""
import sys

from kdtr import bench, kernels
from kdtr.cases import build_problem
from kdtr.launch import DeviceProblem, _cupy, make_launcher

cp = _cupy()
PRODUCER = ("tile wait", "S issue", "S wait+softmax", "P store", "P-full wait")
CONSUMER = ("P-full wait", "alpha+P V issue", "P V wait", "both-consumer bar", "refill+commit")
variants = dict(a.split("=", 1) for a in sys.argv[1:]) or {"base": ""}
specs = (bench.grid(["deepseek-v3"], [8], [256], [32768], [1]) + bench.grid(["deepseek-v3"], [8], [64], [8192], [1])
         + bench.grid(["kimi-k2"], [8], [0], [32768], [32, 1]) + bench.grid(["kimi-k2"], [8], [8], [32768], [32]))
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
        prof = cp.ndarray((16,), cp.uint64, main.module.get_global("kdtr_f90_prof"))
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
