"""Where flash-sm90's main loop spends its cycles: the loop-section profile of cuda/profile.cuh (GPU needed).

    python3 tools/profile.py [-k SPEC] [--model deepseek-v3] [--tp 8] [--budget 64] [--prefix 8k] [--batch 1]
    python3 tools/profile.py -k 'flash-sm90[xr=1]' --model kimi-k2 --budget 8 --prefix 32k --batch 32

SPEC is flash-sm90, with any plan suffix (flash-sm90[splits=4], ...) or planted bug. It is built with the
one compile switch, -DKDTR_PROFILE: each warpgroup role (the producer; the first consumer warpgroup) sums the
cycles of each section of its main loop over the CTAs. Per shape: one warm-up launch, then --launches
launches counted, printed as cycles per KV tile by section, with the CTAs and their tiles. A timing aid for
kernel work, nothing here is checked; the counters cost the build a little, so compare sections and builds
with each other, not with `kdtr bench` times.
"""

from __future__ import annotations

import argparse
import sys

PRODUCER = ("tile wait", "S issue", "S wait+softmax", "P store", "P-full wait")
CONSUMER = ("P-full wait", "alpha+P V issue", "P V wait", "both-consumer bar", "refill+commit")
"""The sections of each role's loop, in the kernel's laps.lap(k) order (cuda/flash_sm90.cu)."""
SLOTS = 32
"""kdtr_profile's length (cuda/profile.cuh): producer sections 0-4, consumer 5-9, tiles 10, CTAs 11."""


def fail(message: str) -> None:
    """Bad input: one line on stderr, exit code 2, before any GPU work."""
    print(f"profile.py: {message}", file=sys.stderr)
    sys.exit(2)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-k", "--kernel", default="flash-sm90", metavar="SPEC", help="flash-sm90[KEY=VALUE,...] (default flash-sm90)")
    ap.add_argument("--model", default="deepseek-v3", help="models, e.g. deepseek-v3,kimi-k2")
    ap.add_argument("--tp", default="8", help="tensor-parallel degrees (default 8)")
    ap.add_argument("--budget", default="64", help="tree budgets, 0 = decode (default 64)")
    ap.add_argument("--prefix", default="8k", help="prefix lengths, e.g. 8k,32k (default 8k)")
    ap.add_argument("--batch", default="1", help="batch sizes (default 1)")
    ap.add_argument("--launches", type=int, default=3, help="launches counted per shape (default 3)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    return ap.parse_args()


def report(name: str, v: list[int]) -> None:
    """One shape's lines from the summed counters ``v`` (kdtr_profile)."""
    tiles, ctas = max(v[10], 1), max(v[11], 1)
    print(f"{name}: {v[11]} CTAs, {v[10] / ctas:.1f} tiles each; cycles per tile:")
    print("  producer  " + "  ".join(f"{n} {v[i] / tiles:6.0f}" for i, n in enumerate(PRODUCER))
          + f"  | sum {sum(v[0:5]) / tiles:6.0f}")
    print("  consumer  " + "  ".join(f"{n} {v[5 + i] / tiles:6.0f}" for i, n in enumerate(CONSUMER))
          + f"  | sum {sum(v[5:10]) / tiles:6.0f}")
    print(f"  per CTA: producer loop {sum(v[0:5]) / ctas:8.0f}, consumer loop {sum(v[5:10]) / ctas:8.0f} cycles")


def main() -> None:
    args = parse_args()
    from kdtr.errors import InputError, KernelSpecError
    from kdtr.inputs.presets import parse_list
    from kdtr.kernels.flash.kernel import profile_build
    from kdtr.kernels.registry import resolve_kernel

    try:
        kernel = resolve_kernel(args.kernel)
        from kdtr.bench.run import grid

        specs = grid(parse_list(args.model, str), parse_list(args.tp, int), parse_list(args.budget, int),
                     parse_list(args.prefix), parse_list(args.batch, int))
    except (KernelSpecError, InputError, ValueError) as e:
        fail(str(e))
    if getattr(getattr(kernel, "variant", None), "label", None) != "flash-sm90":
        fail(f"{args.kernel}: the loop-section counters are flash-sm90's (give flash-sm90[...])")
    if args.launches < 1:
        fail(f"--launches {args.launches}: give 1 or more")

    from kdtr.bench.run import device_problem
    from kdtr.kernels.launch import GpuUnavailable, cupy_module, make_launcher

    try:
        cp = cupy_module()
    except GpuUnavailable as e:
        fail(f"needs a CUDA GPU and cupy: {e}")
    counted = profile_build(kernel)
    for spec in specs:
        dp = device_problem(spec, args.seed)
        why = counted.caps.why_not(dp.problem, spec.out_dtype)
        if why:
            print(f"{spec.name}: skipped ({why})")
            continue
        steps, workspace, splits = counted.steps(dp)
        go = make_launcher(dp, steps, workspace, splits)
        go()  # warm-up: compile, load, clocks, caches
        main = next(s for s in steps if any("_verify<" in e for e in s.loaded.compiled.lowered))  # not the scheduler
        counters = cp.ndarray((SLOTS,), cp.uint64, main.loaded.module.get_global("kdtr_profile"))
        counters[:] = 0
        for _ in range(args.launches):
            go()
        cp.cuda.runtime.deviceSynchronize()
        report(f"{kernel.name} {spec.name}", [int(x) for x in counters.get()])


if __name__ == "__main__":
    main()
