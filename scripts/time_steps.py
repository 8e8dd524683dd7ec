"""Where a flash launch's time goes: the main kernel and the combine timed apart (CUDA events,
L2 flushed, medians), for the split count the plan picks and for forced ones. A timing aid for
docs/PERF.md (decode shapes, where fixed costs dominate); nothing here is checked.

    python3 scripts/time_steps.py [KERNEL] [decode|small]      (default flash-sm90 decode)
"""
import os
import sys

from kdtr.bench import run as bench
from kdtr.kernels.registry import resolve_kernel
from kdtr.kernels.launch import make_launcher
from kdtr.bench.timing import time_launcher

kernel = resolve_kernel(sys.argv[1] if len(sys.argv) > 1 else "flash-sm90")
shape_set = sys.argv[2] if len(sys.argv) > 2 else "decode"
SETS = {  # (model, budget, prefix, batch, forced split counts besides the plan's)
    "decode": [("kimi-k2", 0, p, 1, ("33", "66") if p == 32768 else ()) for p in (256, 2048, 8192, 32768, 131072)]
              + [("kimi-k2", 8, 32768, 1, ("33", "66")), ("deepseek-v3", 64, 8192, 1, ())],
    "small": [("deepseek-v3", 64, 8192, 1, ("4", "14")), ("deepseek-v3", 64, 8192, 8, ("2", "3", "8")),
              ("deepseek-v3", 64, 32768, 1, ("4", "14")), ("deepseek-v3", 256, 8192, 1, ("1", "4"))],
}
shapes = SETS[shape_set]
FLUSH = 256 << 20
print(f"{'shape':34s} {'splits':>6s} {'total us':>9s} {'main us':>8s} {'combine us':>10s}")
for model, budget, prefix, batch, forced_splits in shapes:
    spec = bench.grid([model], [8], [budget], [prefix], [batch])[0]
    dp = bench.device_problem(spec)
    for forced in ("", *forced_splits):
        os.environ["KDTR_FLASH_SPLITS"] = forced
        steps, ws, splits = kernel.steps(dp)
        t = [time_launcher(make_launcher(dp, st, ws, splits), flush_bytes=FLUSH, budget_ms=400)["median_ms"] * 1e3
             for st in (steps, steps[:1], steps[1:])] if len(steps) > 1 else \
            [time_launcher(make_launcher(dp, steps, ws, splits), flush_bytes=FLUSH, budget_ms=400)["median_ms"] * 1e3] * 2 + [0.0]
        print(f"{spec.name[:34]:34s} {splits:6d} {t[0]:9.1f} {t[1]:8.1f} {t[2]:10.1f}")
os.environ.pop("KDTR_FLASH_SPLITS", None)
