"""One table from scripts/sm90_ablate.py logs: a row per shape, a column per variant label (us), in the
order the logs name them. A timing aid for docs/PERF.md (A/B runs, e.g. gpu_check.sh counted); nothing
here is checked.

    python3 scripts/ab_table.py LOG...
"""
import re
import sys

times: dict[str, dict[str, float]] = {}
labels: list[str] = []
for path in sys.argv[1:]:
    shape = None
    for line in open(path, errors="replace"):
        if m := re.match(r"(\S+): floor ", line):
            shape = m.group(1)
        elif shape and (m := re.match(r"  (\S+)\s+([\d.]+) us ", line)):
            label, us = m.group(1), float(m.group(2))
            times.setdefault(shape, {})[label] = us
            labels += [label] if label not in labels else []
width = max([len(s) for s in times] + [5])
print(f"{'shape':{width}s} " + " ".join(f"{lab:>9s}" for lab in labels))
for shape, row in times.items():
    print(f"{shape:{width}s} " + " ".join(f"{row[lab]:9.1f}" if lab in row else f"{'-':>9s}" for lab in labels))
