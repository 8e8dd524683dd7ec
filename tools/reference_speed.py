"""Reference speed and memory: how close the float64 oracle runs to numpy's own matmul rate (CPU only).

    .venv/bin/python tools/reference_speed.py            # rate vs numpy dgemm (P=32k, H=16, T=65)
    .venv/bin/python tools/reference_speed.py --memory   # also peak RSS of a 128k x (16*257 rows) case

Rate = FLOPs over visible (q, key) pairs, 2*H*sum_t(P + depth_t + 1)*(576+512), over wall time.
The float64 matmul peak is measured in the same run on a large square product.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import numpy as np


def matmul_peak(n: int = 3072, reps: int = 3) -> float:
    a = np.random.default_rng(0).standard_normal((n, n))
    b = np.random.default_rng(1).standard_normal((n, n))
    a @ b  # warm-up (thread pool start)
    best = min(_timed(lambda: a @ b) for _ in range(reps))
    return 2 * n**3 / best


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def reference_rate(P: int, H: int, budget: int, reps: int = 2) -> tuple[float, float]:
    from kdtr.inputs.cases import CaseSpec, build_problem
    from kdtr.golden.reference import reference

    prob, _ = build_problem(CaseSpec(heads=H, prefix_lens=(P,), budget=budget, page_size=64))
    pairs = P * prob.T + int((prob.tree_depth.astype(np.int64) + 1).sum())
    flops = 2 * H * pairs * (576 + 512)
    best = min(_timed(lambda: reference(prob)) for _ in range(reps))
    return flops / best, best


def peak_memory(P: int, H: int, budget: int) -> dict:
    """Build + reference of one case in a child process; its peak RSS (ru_maxrss)."""
    code = (
        "import resource, time, json\n"
        "from kdtr.inputs.cases import CaseSpec, build_problem\nfrom kdtr.golden.reference import reference\n"
        f"p,_ = build_problem(CaseSpec(heads={H}, prefix_lens=({P},), budget={budget}))\n"
        "r0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "t = time.perf_counter(); reference(p); t = time.perf_counter() - t\n"
        "print(json.dumps({'inputs_rss_mib': r0/1024, 'peak_rss_mib': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss/1024, 'seconds': t}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--memory", action="store_true", help="also measure peak RSS of a 128k-prefix case")
    args = ap.parse_args()
    peak = matmul_peak()
    rate, secs = reference_rate(32768, 16, 64)
    print(f"numpy float64 matmul peak : {peak / 1e9:8.1f} GFLOP/s")
    print(f"reference P=32k H=16 T=65 : {rate / 1e9:8.1f} GFLOP/s  ({secs:.2f} s)  = {rate / peak:.0%} of peak")
    if args.memory:
        m = peak_memory(131072, 16, 256)
        print(f"reference P=128k H=16 T=257: peak RSS {m['peak_rss_mib']:.0f} MiB "
              f"(inputs {m['inputs_rss_mib']:.0f} MiB), {m['seconds']:.1f} s")
    print(f"(max RSS of this process: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB)")


if __name__ == "__main__":
    main()
