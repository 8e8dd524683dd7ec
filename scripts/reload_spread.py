"""Does flash-sm90's speed depend on where its modules land? The shipped build timed again after its modules are
unloaded and loaded again, K times in one process (each load puts the code at a new address; the bytes are the
same), on Kimi decode shapes where builds of the same code timed 1-2 us apart (docs/PERF.md, session 20). Each
round also loads a padding module first, so that the next loads land elsewhere.

    python3 scripts/reload_spread.py [K] [--first]

--first: round 0 loads no padding module, so the shipped build is the first module loaded after the peaks' torch
kernels (the fast state of run 4) and the later rounds show the other state in the same process. Run 8 (session 20)
ran without it, and before its padding module was loaded explicitly (cupy may defer that); not yet rerun.
"""
import sys

from kdtr import bench, kernels, launch
from kdtr.timing import measure_peaks

args = [a for a in sys.argv[1:] if not a.startswith("--")]
K = int(args[0]) if args else 4
FIRST = "--first" in sys.argv
SPECS = bench.grid(["kimi-k2"], [8], [0], [131072], [1]) + bench.grid(["kimi-k2"], [8], [8], [32768], [1])
PAD = 'extern "C" __global__ void kdtr_pad(float* x) { x[threadIdx.x] *= 2.f; }'
peaks = measure_peaks()
keep = []  # padding modules stay loaded, so each round's flash modules land past them
rows = {spec.name: [] for spec in SPECS}
for k in range(K):
    launch._MODULES.clear()  # the next loads make new modules (old ones stay alive in `keep`)
    if k or not FIRST:
        pad = launch._cupy().RawModule(code=PAD, options=("-DPAD=%d" % k,))
        pad.get_function("kdtr_pad")  # compiled and loaded now (cupy may defer both to the first use)
        keep.append(pad)
    impl = kernels.flash90_build(f"round{k}")
    for spec in SPECS:
        row = bench.bench_shape(spec, [impl], peaks, check=False)
        rows[spec.name].append(row.cells[0].median_ms * 1e3)
    keep.append(impl)
for name, ts in rows.items():
    print(f"{name}: " + " ".join(f"{t:.1f}" for t in ts) + f" us  (spread {max(ts) - min(ts):.1f})")
