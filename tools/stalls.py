"""Where a kernel's warps wait, per SASS instruction: the stall sampler's source page read back from CSV.

    ncu --clock-control none -k regex:kdtr_flash_sm90_verify -s 2 -c 1 --section SourceCounters \\
        --section WarpStateStats -f -o stalls python3 tools/run_once.py flash-sm90 --prefix 32k
    ncu -i stalls.ncu-rep --page source --csv --print-source sass > stalls.csv
    python3 tools/stalls.py stalls.csv [TOP] [--sections]

Prints the share of each stall reason over all samples, then the TOP (default 30) instructions holding the
most samples, each with its two main reasons. --sections also splits the code at each block-wide barrier
(BAR.SYNC) and gives every stretch holding at least 1 % of the samples its share, its instructions a pass (a
pass: an execution of its barrier) and its three main reasons: a loop with a barrier per phase (flash) reads as
its phases. Samples say where warps wait, not what bounds the loop. A diagnosis aid for kernel work: nothing
here is checked.
"""

from __future__ import annotations

import argparse
import csv
import sys
from collections import Counter
from typing import NamedTuple

SAMPLES = "Warp Stall Sampling (All Samples)"
"""ncu's column of stall samples per instruction; the per-reason columns are named stall_<reason>."""
EXECUTED = "Instructions Executed"
"""ncu's column of warp-level executions per instruction (0 where the report lacks it)."""


class Ins(NamedTuple):
    """One instruction row of ncu's source page."""

    index: int
    """Its position in the page."""
    sass: str
    """The SASS text."""
    samples: float
    """Stall samples on it, every reason together."""
    reasons: dict[str, float]
    """Samples per stall reason (the issued and not-issued columns together)."""
    executed: float
    """Warp-level executions (0 where the report lacks the column)."""


def fail(message: str) -> None:
    """Bad input: one line on stderr, exit code 2."""
    print(f"stalls.py: {message}", file=sys.stderr)
    sys.exit(2)


def load(path: str) -> list[Ins]:
    """Every instruction row of an ncu source-page CSV."""
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
        out.append(Ins(idx, d["Source"], float(d[SAMPLES] or 0), stalls, float(d.get(EXECUTED) or 0)))
    return out


class Section(NamedTuple):
    """A stretch of instructions from one BAR.SYNC to the next."""

    first: int
    """Index of its first instruction (its barrier, but for the stretch at the top)."""
    last: int
    """Index of its last instruction."""
    samples: float
    """Stall samples on it."""
    reasons: Counter
    """Samples per stall reason."""
    executed: float
    """Warp-level instructions executed in it."""
    passes: float
    """Executions of its first instruction: once a pass of the loop around it."""


def sections(ins: list[Ins]) -> list[Section]:
    """The stretches of ``ins`` (load's rows) between BAR.SYNCs: the first starts at the top, each later one at its
    barrier."""
    cuts = [0] + [k for k, row in enumerate(ins) if "BAR.SYNC" in row.sass and k > 0] + [len(ins)]
    out = []
    for a, b in zip(cuts, cuts[1:]):
        part = ins[a:b]
        reasons: Counter = Counter()
        for row in part:
            reasons.update(row.reasons)
        out.append(Section(part[0].index, part[-1].index, sum(row.samples for row in part), reasons,
                           sum(row.executed for row in part), part[0].executed or 1.0))
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
    total = sum(row.samples for row in ins) or 1.0
    reasons: Counter = Counter()
    for row in ins:
        reasons.update(row.reasons)
    print(f"{path}: {len(ins)} instructions, {total:.0f} samples")
    print("reasons: " + ", ".join(f"{k} {v / total:.1%}" for k, v in reasons.most_common(8)))
    for idx, src, s, st, _ in sorted(ins, key=lambda x: -x.samples)[:top]:
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
