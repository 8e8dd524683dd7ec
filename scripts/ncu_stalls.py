"""Where a kernel's warps wait, per SASS instruction, from `gpu_check.sh ncusrc` output (ncu --page
source --csv --print-source sass): the instructions holding the most stall samples, with their
main reasons, and the share of each reason overall. A diagnosis aid for docs/PERF.md.

    python3 scripts/ncu_stalls.py FILE.csv [TOP]
"""
import csv
import sys
from collections import Counter


def load(path):
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    head = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    cols = rows[head]
    out = []
    for idx, r in enumerate(rows[head + 1:]):
        if len(r) != len(cols):
            continue
        d = dict(zip(cols, r))
        stalls = {c[6:]: float(d[c] or 0) for c in cols if c.startswith("stall_") and "(" not in c}
        out.append((idx, d["Source"], float(d["Warp Stall Sampling (All Samples)"] or 0), stalls))
    return out


def main():
    path, top = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 30
    ins = load(path)
    total = sum(s for _, _, s, _ in ins) or 1.0
    reasons = Counter()
    for _, _, _, st in ins:
        reasons.update(st)
    print(f"{path}: {len(ins)} instructions, {total:.0f} samples")
    print("reasons: " + ", ".join(f"{k} {v / total:.1%}" for k, v in reasons.most_common(8)))
    for idx, src, s, st in sorted(ins, key=lambda x: -x[2])[:top]:
        why = ", ".join(f"{k} {v / s:.0%}" for k, v in Counter(st).most_common(2) if v) if s else ""
        print(f"{idx:5d} {s / total:6.1%}  {src[:60]:60s} {why}")


if __name__ == "__main__":
    main()
