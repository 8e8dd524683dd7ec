"""flash-sm90 built with -D experiment knobs, verified on the ci suite before any of its timings
count: PASS / FAIL counts, whether two runs give the same bits (`--repeat 2`), and the tolerance margin left
(worst element ratio and relative norm against their bounds, over every case). A gate for
scripts/sm90_ablate.py and scripts/f90_profile.py experiments, not a test (tests/ cover the default build).

    python3 scripts/knob_verify.py [--bits] LABEL=OPTS ...     e.g. notma=-DKDTR_F90_NO_TMA

--bits: also run each build and the plain one on a few bench shapes (the 64-row, merging, segments and transposed-rows
builds among them) on the same random inputs and count the output bits that differ: a knob that only reorders work
or skips multiplications by exactly 1 must give 0.
"""
import sys

import numpy as np

from kdtr.bench import run as bench
from kdtr.kernels import registry as kernels
from kdtr.golden.store import find_bundles
from kdtr.check.suite import run_verify

BITS_SHAPES = (bench.grid(["deepseek-v3"], [8], [64], [8192], [1, 8]) + bench.grid(["deepseek-v3"], [8], [256], [8192], [1])
               + bench.grid(["kimi-k2"], [8], [4, 8], [32768], [1]) + bench.grid(["kimi-k2"], [8], [8], [32768], [8]))


def differing_bits(kernel) -> str:
    """Output elements (out, lse) of ``kernel`` whose bits differ from the plain build's, per BITS_SHAPES shape."""
    plain, cells = kernels.flash90_build("plain"), []
    for spec in BITS_SHAPES:
        dp = bench.device_problem(spec, seed=1)
        a, b = plain.run_on(dp), kernel.run_on(dp)
        n = int(np.sum(a.out.view(np.uint32) != b.out.view(np.uint32)) + np.sum(a.lse.view(np.uint32) != b.lse.view(np.uint32)))
        cells.append(f"{spec.name.split('-pg')[0]}: {n}")
    return ", ".join(cells)


BITS = "--bits" in sys.argv
paths = find_bundles(["ci"])
bad = 0
for arg in (a for a in sys.argv[1:] if a != "--bits"):
    label, opts = arg.split("=", 1)
    kernel = kernels.flash90_build(label, opts)
    rep = run_verify(kernel, paths, repeat=2)
    worst = [(r.case, r.status.value, r.message) for r in rep.results if r.status.failed]
    print(f"{label:10s} {rep.counts} {'FAILED ' + str(worst[:3]) if rep.failed else 'ok'}")
    for output in ("out", "lse"):  # the margin a build leaves: its worst element ratio and relative norm over the suite
        checks = [(c.ratio, c.rel_norm / c.tol.rel_norm, r.case) for r in rep.results for c in r.checks if c.output == output]
        if checks:
            ratio, norm = max(checks), max(checks, key=lambda x: x[1])
            print(f"{'':10s} {output}: worst element {ratio[0]:.3f} of its tolerance ({ratio[2]}), "
                  f"worst rel. norm {norm[1]:.3f} of its bound ({norm[2]})")
    if BITS:
        print(f"{'':10s} bits differing from the plain build: {differing_bits(kernel)}")
    bad += rep.failed
sys.exit(1 if bad else 0)
