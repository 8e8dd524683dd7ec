"""Clock and power under sustained launches: each kernel launched back to back on one shape, nvidia-smi sampling.

    python3 tools/clocks.py -k flash-sm90 -k flashmla-mtp --model deepseek-v3 --budget 256 --prefix 32k
    python3 tools/clocks.py -k flash-sm90 -k flashmla-mtp --model kimi-k2 --budget 8 --prefix 32k --batch 32 --json c.json

A kernel's time in a bench is one cold launch; a server runs them back to back, where the card's power limit and
clock management decide the SM clock. Per shape and spec (a kernel spec, or a peer baseline such as flashmla-mtp,
as `kdtr bench --baselines` names it) this launches for --seconds without an L2 flush, while nvidia-smi samples
every 50 ms the SM clock, the board power and the active clock-event reasons (the NVML bits: why the clock is below
its maximum). It prints the time a launch, the samples' median clock and power, the cycles a launch at that clock
(time x clock: what a loop's design changes, where time also moves with the clock), and the reasons seen in at
least a quarter of the samples. The samples of the first 0.3 s and the last 0.1 s are dropped (ramp and tail).
Nothing here is checked: it describes the card under a kernel. Check a spec first with `kdtr verify -k SPEC ci`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

REASONS = {0x1: "idle", 0x2: "app-clocks", 0x4: "sw-power-cap", 0x8: "hw-slowdown", 0x10: "sync-boost",
           0x20: "sw-thermal", 0x40: "hw-thermal", 0x80: "hw-power-brake", 0x100: "display-clock"}
"""NVML's clock-event reason bits (nvidia-smi's clocks_event_reasons.active)."""
QUERY = "clocks.sm,power.draw,clocks_event_reasons.active"
PERIOD_MS = 50
RAMP_S, TAIL_S = 0.3, 0.1


def fail(message: str) -> None:
    """Bad input: one line on stderr, exit code 2, before any GPU work."""
    print(f"clocks.py: {message}", file=sys.stderr)
    sys.exit(2)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-k", "--kernel", action="append", default=[], metavar="SPEC",
                    help="kernel spec or peer baseline (flashmla-mtp, sglang-triton, torch-eager); one or more")
    ap.add_argument("--model", default="deepseek-v3", help="models, e.g. deepseek-v3,kimi-k2 (default deepseek-v3)")
    ap.add_argument("--tp", default="8", help="tensor-parallel degrees (default 8)")
    ap.add_argument("--budget", default="64", help="tree budgets, 0 = decode (default 64)")
    ap.add_argument("--prefix", default="8k", help="prefix lengths, e.g. 8k,32k (default 8k)")
    ap.add_argument("--batch", default="1", help="batch sizes (default 1)")
    ap.add_argument("--seconds", type=float, default=1.5, help="launching time a spec and shape (default 1.5, >= 1)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    ap.add_argument("--json", metavar="PATH", help="also write the rows here")
    return ap.parse_args(argv)


def reason_names(mask: int) -> list[str]:
    """The names of the bits set in a clock-event reason mask (unknown bits as hex)."""
    names = [name for bit, name in REASONS.items() if mask & bit]
    rest = mask & ~sum(REASONS)
    return names + ([hex(rest)] if rest else [])


def summarize_samples(lines: list[str]) -> dict:
    """nvidia-smi's CSV lines (clock MHz, power W, reason mask; no header, no units) as the median clock and power
    and the reasons active in at least a quarter of the samples; lines that do not parse are counted, not used."""
    import numpy as np

    mhz, watts, seen, bad = [], [], {}, 0
    for line in lines:
        parts = [p.strip() for p in line.split(",")]
        try:
            clock, power, mask = float(parts[0]), float(parts[1]), int(parts[2], 16)
        except (IndexError, ValueError):
            bad += 1
            continue
        mhz.append(clock)
        watts.append(power)
        for name in reason_names(mask):
            seen[name] = seen.get(name, 0) + 1
    n = len(mhz)
    return {"samples": n, "unparsed": bad, "mhz": float(np.median(mhz)) if n else None,
            "watts": float(np.median(watts)) if n else None,
            "reasons": sorted(name for name, count in seen.items() if count * 4 >= n) if n else []}


def sustain(go, seconds: float) -> tuple[float, dict]:
    """Launches ``go`` back to back for ``seconds`` under nvidia-smi: (ms a launch, summarize_samples)."""
    from kdtr.kernels.launch import cupy_module

    cp = cupy_module()
    for _ in range(3):
        go()
    cp.cuda.runtime.deviceSynchronize()
    smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits", "-lms",
                            str(PERIOD_MS)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    start, end = cp.cuda.Event(), cp.cuda.Event()
    launches, t0 = 0, time.time()
    start.record()
    while time.time() - t0 < seconds:
        for _ in range(4):
            go()
        launches += 4
        if launches % 16 == 0:  # keep the queue short, so that the loop's time is the launches' time
            end.record()
            end.synchronize()
    end.record()
    end.synchronize()
    ms = cp.cuda.get_elapsed_time(start, end) / launches
    smi.terminate()
    lines = smi.communicate()[0].strip().splitlines()
    ramp, tail = int(RAMP_S * 1000 / PERIOD_MS), int(TAIL_S * 1000 / PERIOD_MS)
    return ms, summarize_samples(lines[ramp:len(lines) - tail])


def impl_of(spec: str):
    """A peer baseline by its bench name (kdtr.bench.baselines.baseline knows them), else a kernel spec
    (KernelSpecError naming a bad one)."""
    from kdtr.bench.baselines import baseline
    from kdtr.kernels.registry import resolve_kernel

    try:
        return baseline(spec)
    except ValueError:  # not a baseline's name
        return resolve_kernel(spec)


def main() -> None:
    args = parse_args()
    if not args.kernel:
        fail("name one spec or more with -k, e.g. -k flash-sm90 -k flashmla-mtp")
    if not args.seconds >= 1:
        fail(f"--seconds {args.seconds}: give 1 or more (the first 0.3 s of samples are dropped)")
    try:
        from kdtr.bench.run import grid
        from kdtr.inputs.presets import parse_list

        impls = [impl_of(s) for s in args.kernel]
        specs = grid(parse_list(args.model, str), parse_list(args.tp, int), parse_list(args.budget, int),
                     parse_list(args.prefix), parse_list(args.batch, int))
    except Exception as e:  # a bad spec, model or number: one line, before any GPU work
        fail(" ".join(str(e).split()))
    from kdtr.bench.run import device_problem
    from kdtr.kernels.launch import cupy_module

    rows = []
    print(f"{'shape':44s} {'spec':16s} {'us':>10s} {'MHz':>6s} {'W':>6s} {'kcycles':>9s}  reasons", flush=True)
    for spec in specs:
        dp = device_problem(spec, seed=args.seed)
        for name, impl in zip(args.kernel, impls):
            why = impl.caps.why_not(dp.problem, spec.out_dtype) or getattr(impl, "untimed", None)
            if why:
                print(f"{spec.name:44s} {name:16s} skipped: {why}", flush=True)
                continue
            ms, smp = sustain(impl.prepare(dp), args.seconds)
            kcycles = ms * smp["mhz"] if smp["mhz"] else None  # ms x MHz = 1e3 cycles
            rows.append({"shape": spec.name, "spec": name, "us": ms * 1e3, "kcycles": kcycles, **smp})
            print(f"{spec.name:44s} {name:16s} {ms * 1e3:10.1f} {smp['mhz'] or 0:6.0f} {smp['watts'] or 0:6.0f} "
                  f"{kcycles or 0:9.1f}  {','.join(smp['reasons']) or '-'}", flush=True)
        del dp
        cupy_module().get_default_memory_pool().free_all_blocks()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"seconds": args.seconds, "period_ms": PERIOD_MS, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
