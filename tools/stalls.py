"""Where a kernel's warps wait, per SASS instruction: the stall sampler's source page read back from CSV.

    ncu --clock-control none -k regex:kdtr_flash_sm90_verify -s 2 -c 1 --section SourceCounters \\
        --section WarpStateStats -f -o stalls python3 tools/run_once.py flash-sm90 --prefix 32k
    ncu -i stalls.ncu-rep --page source --csv --print-source sass > stalls.csv
    python3 tools/stalls.py stalls.csv [TOP] [--sections]

Prints the share of each stall reason over all samples, then the TOP (default 30) instructions holding the
most samples, each with its two main reasons. --sections also splits the code at each block-wide barrier
(BAR.SYNC) and gives every stretch holding at least 1 % of the samples its share, its instructions a pass (a pass: an
execution of its barrier) and its three main reasons: a loop with a
barrier per phase (flash) reads as its phases. Samples say where warps wait, not what bounds the loop. A
diagnosis aid for kernel work: nothing here is checked.
"""

from __future__ import annotations

import argparse
import csv
import sys
from collections import Counter

SAMPLES = "Warp Stall Sampling (All Samples)"
"""ncu's column of stall samples per instruction; the per-reason columns are named stall_<reason>."""
EXECUTED = "Instructions Executed"
"""ncu's column of warp-level executions per instruction (0 where the report lacks it)."""


def fail(message: str) -> None:
    """Bad input: one line on stderr, exit code 2."""
    print(f"stalls.py: {message}", file=sys.stderr)
    sys.exit(2)


def load(path: str) -> list[tuple[int, str, float, dict[str, float], float]]:
    """(index, SASS text, samples, {reason: samples}, executions) of every instruction row of an ncu source-page CSV."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    head = next((i for i, r in enumerate(rows) if r and r[0] == "Address"), None)
    if head is None or SAMPLES not in rows[head]:
        raise ValueError(f"{path}: no ncu source page with a {SAMPLES!r} column (see this tool's docstring)")
    cols = rows[head]
    out = []
    for idx, r in enumerate(rows[head + 1:]):
        if len(r) != len(cols):
            continue
        d = dict(zip(cols, r))
        stalls = {c[len("stall_"):]: float(d[c] or 0) for c in cols if c.startswith("stall_") and "(" not in c}
        out.append((idx, d["Source"], float(d[SAMPLES] or 0), stalls, float(d.get(EXECUTED) or 0)))
    return out


def sections(ins: list) -> list[tuple[int, int, float, Counter, float, float]]:
    """(first index, last index, samples, reasons, instructions executed, passes) of each stretch of ``ins`` (load's
    rows) from one BAR.SYNC to the next: the first stretch starts at the top, each later one at its barrier. Passes:
    the executions of the stretch's first instruction (its barrier: once a pass of the loop around it)."""
    cuts = [0] + [k for k, row in enumerate(ins) if "BAR.SYNC" in row[1] and k > 0] + [len(ins)]
    out = []
    for a, b in zip(cuts, cuts[1:]):
        part = ins[a:b]
        reasons: Counter = Counter()
        for row in part:
            reasons.update(row[3])
        out.append((part[0][0], part[-1][0], sum(row[2] for row in part), reasons, sum(row[4] for row in part),
                    part[0][4] or 1.0))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv", metavar="FILE.csv", help="ncu's source page as CSV (see below)")
    ap.add_argument("top", metavar="TOP", type=int, nargs="?", default=30, help="instructions listed (default 30)")
    ap.add_argument("--sections", action="store_true", help="also the shares of the stretches between BAR.SYNCs")
    args = ap.parse_args()
    path, top = args.csv, args.top
    try:
        ins = load(path)
    except (OSError, ValueError) as e:
        fail(str(e))
    total = sum(row[2] for row in ins) or 1.0
    reasons: Counter = Counter()
    for row in ins:
        reasons.update(row[3])
    print(f"{path}: {len(ins)} instructions, {total:.0f} samples")
    print("reasons: " + ", ".join(f"{k} {v / total:.1%}" for k, v in reasons.most_common(8)))
    for idx, src, s, st, _ in sorted(ins, key=lambda x: -x[2])[:top]:
        why = ", ".join(f"{k} {v / s:.0%}" for k, v in Counter(st).most_common(2) if v) if s else ""
        print(f"{idx:5d} {s / total:6.1%}  {src[:60]:60s} {why}")
    if args.sections:
        print("sections between BAR.SYNCs (>= 1 % of the samples):")
        for first, last, s, st, executed, passes in sections(ins):
            if s / total >= 0.01:
                why = ", ".join(f"{k} {v / s:.0%}" for k, v in st.most_common(3) if v)
                print(f"{first:5d}-{last:<5d} {s / total:6.1%}  {executed / passes:5.0f} instructions x {passes:.0f} passes  {why}")


if __name__ == "__main__":
    main()
