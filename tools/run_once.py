"""One kernel spec on one shape, launched a few times on fresh random inputs: the program that a profiler or a
sanitizer wraps (ncu, compute-sanitizer, nsys); with --steps, the plan's launches also timed together and apart.

    python3 tools/run_once.py SPEC [--model kimi-k2] [--tp 8] [--budget 8] [--prefix 32k] [--batch 1] [--launches 3]
    ncu -k regex:flash_sm90 -s 2 -c 1 python3 tools/run_once.py flash-sm90 --model kimi-k2 --prefix 128k
    python3 tools/run_once.py 'flash-sm90[splits=33]' --model kimi-k2 --budget 0 --prefix 32k --steps

It prints the plan (each launch's grid, block and shared memory; the workspace and split count), then runs
--launches launches (the first compiles and loads; a profiler skips it with -s 1 or more). --steps times the whole
plan, then each launch alone (the main kernel, the combine where there is one), with kdtr's own timing
(kdtr.bench.timing.time_launcher: CUDA-event medians, the L2 flushed before every repetition); a launch alone
runs on a zero-filled workspace, so its time is that step's cost, its output nothing to check.
"""

from __future__ import annotations

import argparse
import sys


def fail(message: str) -> None:
    """Bad input: one line on stderr, exit code 2, before any GPU work."""
    print(f"run_once.py: {message}", file=sys.stderr)
    sys.exit(2)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("spec", help="kernel spec: built-in, NAME[KEY=VALUE,...] or file.cu:symbol")
    ap.add_argument("--model", default="kimi-k2", help="model preset (default kimi-k2)")
    ap.add_argument("--tp", type=int, default=8, help="tensor-parallel degree (default 8)")
    ap.add_argument("--budget", type=int, default=8, help="tree budget, 0 = decode (default 8)")
    ap.add_argument("--prefix", default="32k", help="prefix length, e.g. 32k (default 32k)")
    ap.add_argument("--batch", type=int, default=1, help="batch size (default 1)")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--kv-dtype", default="bf16")
    ap.add_argument("--out-dtype", default=None, help="default: the kv dtype")
    ap.add_argument("--launches", type=int, default=3, help="launches to run (default 3)")
    ap.add_argument("--steps", action="store_true", help="also time the plan's launches together and apart")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    if args.launches < 1:
        fail(f"--launches {args.launches}: give 1 or more")
    from kdtr.bench.run import device_problem, grid
    from kdtr.errors import InputError, KernelSpecError
    from kdtr.inputs.presets import parse_size
    from kdtr.kernels.launch import gpu_available, gpu_unavailable_reason
    from kdtr.kernels.registry import resolve_kernel

    try:
        kernel = resolve_kernel(args.spec)
        spec = grid([args.model], [args.tp], [args.budget], [parse_size(args.prefix)], [args.batch], args.page_size,
                    args.kv_dtype, args.out_dtype or args.kv_dtype)[0]
    except (KernelSpecError, InputError, ValueError) as e:
        fail(str(e))
    if not hasattr(kernel, "steps"):
        fail(f"{args.spec}: no launch plan to run (run_once.py launches CUDA kernels: built-ins and file.cu:symbol)")
    if not gpu_available():
        fail(f"needs a CUDA GPU and cupy: {gpu_unavailable_reason()}")
    dp = device_problem(spec, args.seed)
    why = kernel.caps.why_not(dp.problem, spec.out_dtype)
    if why:
        fail(f"{args.spec} does not take {spec.name}: {why}")
    steps, workspace, splits = kernel.steps(dp)
    print(f"{args.spec} on {spec.name}: {len(steps)} launch{'es' if len(steps) > 1 else ''}, "
          f"{splits} split{'s' if splits > 1 else ''}, workspace {workspace} B")
    for i, step in enumerate(steps):
        print(f"  launch {i}: grid {tuple(step.grid)}, block {tuple(step.block)}, dynamic shared memory {step.smem} B")
    for _ in range(args.launches):
        kernel.run_on(dp)  # poisons, launches, synchronizes, downloads: a fault stops here with its message
    print(f"ran {args.launches} time{'s' if args.launches > 1 else ''}")
    if args.steps:
        from kdtr.bench.timing import l2_flush_bytes, time_launcher
        from kdtr.kernels.launch import device_info, make_launcher

        flush = l2_flush_bytes(device_info()["l2_bytes"])
        parts = [("all", steps)] + ([(f"launch {i}", [s]) for i, s in enumerate(steps)] if len(steps) > 1 else [])
        for label, part in parts:
            t = time_launcher(make_launcher(dp, part, workspace, splits), flush_bytes=flush)
            print(f"  {label:9s} {t['median_ms'] * 1e3:9.1f} us (IQR {t['iqr_ms'] * 1e3:.1f}, {t['reps']} repetitions)")


if __name__ == "__main__":
    main()
