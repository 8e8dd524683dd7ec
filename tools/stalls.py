"""Where a kernel's warps wait, per SASS instruction: the stall sampler's source page read back from CSV.

    ncu --clock-control none -k regex:kdtr_flash_sm90_verify -s 2 -c 1 --section SourceCounters \\
        --section WarpStateStats -f -o stalls python3 tools/run_once.py flash-sm90 --prefix 32k
    ncu -i stalls.ncu-rep --page source --csv --print-source sass > stalls.csv
    python3 tools/stalls.py stalls.csv [TOP]

Prints the share of each stall reason over all samples, then the TOP (default 30) instructions holding the
most samples, each with its two main reasons. A diagnosis aid for kernel work: nothing here is checked.
"""

from __future__ import annotations

import argparse
import csv
import sys
from collections import Counter

SAMPLES = "Warp Stall Sampling (All Samples)"
"""ncu's column of stall samples per instruction; the per-reason columns are named stall_<reason>."""


def fail(message: str) -> None:
    """Bad input: one line on stderr, exit code 2."""
    print(f"stalls.py: {message}", file=sys.stderr)
    sys.exit(2)


def load(path: str) -> list[tuple[int, str, float, dict[str, float]]]:
    """(index, SASS text, samples, {reason: samples}) of every instruction row of an ncu source-page CSV."""
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
        out.append((idx, d["Source"], float(d[SAMPLES] or 0), stalls))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv", metavar="FILE.csv", help="ncu's source page as CSV (see below)")
    ap.add_argument("top", metavar="TOP", type=int, nargs="?", default=30, help="instructions listed (default 30)")
    args = ap.parse_args()
    path, top = args.csv, args.top
    try:
        ins = load(path)
    except (OSError, ValueError) as e:
        fail(str(e))
    total = sum(s for _, _, s, _ in ins) or 1.0
    reasons: Counter = Counter()
    for _, _, _, st in ins:
        reasons.update(st)
    print(f"{path}: {len(ins)} instructions, {total:.0f} samples")
    print("reasons: " + ", ".join(f"{k} {v / total:.1%}" for k, v in reasons.most_common(8)))
    for idx, src, s, st in sorted(ins, key=lambda x: -x[2])[:top]:
        why = ", ".join(f"{k} {v / s:.0%}" for k, v in Counter(st).most_common(2) if v) if s else ""
        print(f"{idx:5d} {s / total:6.1%}  {src[:60]:60s} {why}")


if __name__ == "__main__":
    main()
