"""A/B timer: two or more kernel specs timed on the same shapes in one process, interleaved.

    python3 tools/ab.py -k flash-sm90 -k 'flash-sm90[xr=1]' --set memory [--rounds 3] [--json ab.json]
    python3 tools/ab.py -k flash-sm90 -k path/my_kernel.cu:my_verify --model kimi-k2 --budget 0,8 --prefix 32k

Per shape every spec launches on the same device inputs (kdtr.bench.run.device_problem, kernel.prepare), timed by
kdtr's own timing (kdtr.bench.timing.time_launcher: CUDA-event medians, the L2 flushed before every repetition) in
--rounds rounds, the spec order reversed every other round so that no spec is always first. A spec's time is the
median of its round medians and its spread half the range of them. The table gives each spec's time in us and, for
every spec after the first (A), A's time over its own (above 1: faster than A), and how many output elements
differ from A's bit for bit (0: the same results). Check a spec first with `kdtr verify -k SPEC ci`: this only times.
"""

from __future__ import annotations

import argparse
import json
import string
import sys
from pathlib import Path


def fail(message: str) -> None:
    """Bad input: one line on stderr, exit code 2, before any GPU work."""
    print(f"ab.py: {message}", file=sys.stderr)
    sys.exit(2)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-k", "--kernel", action="append", default=[], metavar="SPEC",
                    help="kernel spec (built-in, NAME[KEY=VALUE,...], file.cu:symbol); two or more, the first is A")
    ap.add_argument("--set", action="append", default=[], metavar="NAME", help="named shape set: compute, memory")
    ap.add_argument("--model", help="grid: models, e.g. deepseek-v3,kimi-k2 (default deepseek-v3)")
    ap.add_argument("--tp", help="grid: tensor-parallel degrees (default 8)")
    ap.add_argument("--budget", help="grid: tree budgets, 0 = decode (default 64)")
    ap.add_argument("--prefix", help="grid: prefix lengths, e.g. 8k,32k (default 8k)")
    ap.add_argument("--batch", help="grid: batch sizes (default 1)")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--kv-dtype", default="bf16")
    ap.add_argument("--out-dtype", default=None, help="default: the kv dtype")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds per shape (default 3)")
    ap.add_argument("--budget-ms", type=float, default=500.0, help="timing budget of one spec in one round (default 500)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    ap.add_argument("--json", metavar="PATH", help="also write every round's times here")
    return ap.parse_args()


def shapes(args) -> list:
    """The CaseSpecs that --set and the grid options name (ValueError / InputError naming a bad value)."""
    from kdtr.bench.run import grid
    from kdtr.inputs.presets import BENCH_GRIDS, parse_list

    out_dtype = args.out_dtype or args.kv_dtype
    specs = []
    for name in args.set:
        if name not in BENCH_GRIDS:
            raise ValueError(f"--set {name}: unknown shape set; known: {', '.join(BENCH_GRIDS)}")
        g = BENCH_GRIDS[name]
        specs += grid(g["models"], g["tps"], g["budgets"], g["prefixes"], g["batches"], args.page_size, args.kv_dtype,
                      out_dtype)
    if args.prefix or args.budget:
        specs += grid(parse_list(args.model or "deepseek-v3", str), parse_list(args.tp or "8", int),
                      parse_list(args.budget or "64", int), parse_list(args.prefix or "8k"),
                      parse_list(args.batch or "1", int), args.page_size, args.kv_dtype, out_dtype)
    return specs


def differing(a, b) -> int:
    """Output elements (out, and lse where both write it) whose float32 bits differ between two runs."""
    import numpy as np

    n = int(np.sum(a.out.view(np.uint32) != b.out.view(np.uint32)))
    if a.lse is not None and b.lse is not None:
        n += int(np.sum(a.lse.view(np.uint32) != b.lse.view(np.uint32)))
    return n


def time_shape(spec, kernels: list, peaks: dict, args) -> dict:
    """Every kernel on one shape: its round medians (ms), or why it was not timed; bits differing from the first."""
    import numpy as np

    from kdtr.bench.run import device_problem, min_bytes, roofline_ms
    from kdtr.bench.timing import l2_flush_bytes, time_launcher
    from kdtr.inputs.problem import visible_flops

    dp = device_problem(spec, args.seed)
    layout = dp.problem
    flops, nbytes = visible_flops(layout.prefix_lens, layout.tree_depth, layout.H), min_bytes(layout, spec.out_dtype)
    row = {"shape": spec.name, "dims": {"model": spec.model, "T": spec.T, "P": max(spec.prefix_lens), "B": spec.B},
           "roofline_ms": roofline_ms(flops, nbytes, peaks), "cells": []}
    launchers, first = {}, None
    for i, k in enumerate(kernels):
        cell = {"spec": k.name, "status": "ok", "rounds_ms": [], "differing": None}
        row["cells"].append(cell)
        why = k.caps.why_not(layout, spec.out_dtype)
        if why:
            cell["status"] = f"skipped: {why}"
            continue
        try:
            got = k.run_on(dp)
            first = got if i == 0 else first
            cell["differing"] = differing(first, got) if first is not None else None
            launchers[i] = k.prepare(dp)
        except Exception as e:  # a compile or launch failure of one spec: its cell says so, the others go on
            cell["status"] = f"error: {type(e).__name__}: {' '.join(str(e).split())[:120]}"
    flush = l2_flush_bytes(peaks.get("l2_bytes"))
    order = list(launchers)
    for r in range(args.rounds):
        for i in order if r % 2 == 0 else order[::-1]:
            t = time_launcher(launchers[i], flush_bytes=flush, budget_ms=args.budget_ms)
            row["cells"][i]["rounds_ms"].append(t["median_ms"])
    for c in (row["cells"][i] for i in order):
        c["median_ms"] = float(np.median(c["rounds_ms"]))
        c["spread_ms"] = (max(c["rounds_ms"]) - min(c["rounds_ms"])) / 2
    return row


def print_table(rows: list[dict], specs: list[str]) -> None:
    """One line per shape: the floor, each spec's time ± spread, A's time over each later spec's, bits differing."""
    import numpy as np

    letters = string.ascii_uppercase
    for i, s in enumerate(specs):
        print(f"{letters[i]} = {s}")
    head = f"{'shape':28s} {'floor us':>8s} " + " ".join(f"{letters[i] + ' us':>14s}" for i in range(len(specs)))
    head += "".join(f" {'A/' + letters[i]:>6s} {'bits':>5s}" for i in range(1, len(specs)))
    print(head)
    ratios: dict[int, list[float]] = {}
    for row in rows:
        d = row["dims"]
        tag = f"{d['model']} T{d['T']} P{d['P'] // 1024}k B{d['B']}" if d["P"] % 1024 == 0 else row["shape"][:28]
        line = f"{tag:28s} {row['roofline_ms'] * 1e3:8.1f} "
        cells = row["cells"]
        line += " ".join(f"{c['median_ms'] * 1e3:8.1f}±{c['spread_ms'] * 1e3:<5.1f}" if "median_ms" in c
                         else f"{c['status'][:14]:>14s}" for c in cells)
        a = cells[0].get("median_ms")
        for i, c in enumerate(cells[1:], 1):
            if a and "median_ms" in c and c["differing"] is not None:
                ratios.setdefault(i, []).append(a / c["median_ms"])
                line += f" {a / c['median_ms']:5.3f}x {c['differing']:5d}"
            else:
                line += f" {'-':>6s} {'-':>5s}"
        print(line)
        for c in cells:
            if c["status"] != "ok":
                print(f"  {c['spec']}: {c['status']}")
    for i, rs in sorted(ratios.items()):
        print(f"A/{letters[i]}: geometric mean {float(np.exp(np.mean(np.log(rs)))):.3f}x over {len(rs)} shapes "
              f"(above 1: {letters[i]} faster)")


def main() -> None:
    args = parse_args()
    if len(args.kernel) < 2:
        fail("give two or more kernel specs, e.g. -k flash-sm90 -k 'flash-sm90[xr=1]'")
    if len(args.kernel) > 26:
        fail("at most 26 kernel specs (A to Z)")
    if args.rounds < 1:
        fail(f"--rounds {args.rounds}: give 1 or more")
    if args.json and not Path(args.json).resolve().parent.is_dir():
        fail(f"--json {args.json}: its folder does not exist")
    if not (args.set or args.prefix or args.budget):
        fail("no shapes: give --set compute / memory, or a grid (--prefix and / or --budget, with --model --tp --batch)")
    from kdtr.bench.timing import measure_peaks
    from kdtr.errors import InputError, KernelSpecError
    from kdtr.kernels.launch import gpu_available, gpu_unavailable_reason
    from kdtr.kernels.registry import resolve_kernel

    try:
        specs = shapes(args)
        kernels = [resolve_kernel(s) for s in args.kernel]
    except (KernelSpecError, InputError, ValueError) as e:
        fail(str(e))
    untimed = [k.name for k in kernels if not hasattr(k, "prepare")]
    if untimed:
        fail(f"{', '.join(untimed)}: no launcher to time (ab.py times kernels that have prepare(): CUDA kernels)")
    if len({k.name for k in kernels}) < len(kernels):
        fail("a kernel spec is given twice: each spec once (the rounds repeat it)")
    if not gpu_available():
        fail(f"needs a CUDA GPU and cupy: {gpu_unavailable_reason()}")
    peaks = measure_peaks()  # the roofline's two ceilings and the mma.sync one, measured in this process like the times
    from kdtr.cli.bench import mma_text

    print(f"peaks on {peaks['device']}: copy {peaks['copy_gbs']:.0f} GB/s, bf16 GEMM {peaks['gemm_tflops']:.0f} TFLOP/s, "
          f"{mma_text(peaks)}; {len(specs)} shapes, {args.rounds} rounds", flush=True)
    rows = [time_shape(s, kernels, peaks, args) for s in specs]
    print_table(rows, [k.name for k in kernels])
    if args.json:
        from kdtr.golden.atomic import atomic_write_bytes

        atomic_write_bytes(args.json, (json.dumps({"peaks": peaks, "specs": args.kernel, "rows": rows}, indent=1,
                                                  default=str) + "\n").encode())


if __name__ == "__main__":
    main()
