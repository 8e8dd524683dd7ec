"""flash-sm90 built with -D experiment knobs, verified on the ci suite before any of its timings
count: PASS / FAIL counts, whether two runs give the same bits (`--repeat 2`), and the tolerance margin left
(worst element ratio and relative norm against their bounds, over every case). A gate for
scripts/sm90_ablate.py and scripts/f90_profile.py experiments, not a test (tests/ cover the default build).

    python3 scripts/knob_verify.py LABEL=OPTS ...     e.g. notma=-DKDTR_F90_NO_TMA
"""
import sys

from kdtr import kernels
from kdtr.verify import find_bundles, run_verify

paths = find_bundles(["ci"])
bad = 0
for arg in sys.argv[1:]:
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
    bad += rep.failed
sys.exit(1 if bad else 0)
