"""Run one kernel once on one bench shape (fresh random inputs): the target of a profiler run.

    python3 scripts/run_once.py KERNEL MODEL TP BUDGET PREFIX BATCH     e.g. flash-sm90 deepseek-v3 8 256 32768 1
"""
import sys

from kdtr.bench import run as bench
from kdtr.kernels.registry import resolve_kernel

name, model, tp, budget, prefix, batch = sys.argv[1:7]
spec = bench.grid([model], [int(tp)], [int(budget)], [int(prefix)], [int(batch)])[0]
dp = bench.device_problem(spec)
kernel = resolve_kernel(name)
for _ in range(3):
    kernel.run_on(dp)
print(f"ran {name} on {spec.name}")
