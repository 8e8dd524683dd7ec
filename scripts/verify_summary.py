"""One line per case of `kdtr verify --json` reports: kernel, case, status, worst ratio, kernel ms."""
import json
import sys

for path in sys.argv[1:]:
    rep = json.load(open(path))
    for r in rep["results"]:
        out = next((c for c in r["checks"] if c["output"] == "out"), {})
        print(f"{rep['kernel']:8s} {r['case'][:52]:52s} {r['status']:13s} ratio {out.get('ratio', 0):7.3f} "
              f"relnorm {out.get('rel_norm', 0):9.2e} ms {r['ms'] or 0:9.3f}")
