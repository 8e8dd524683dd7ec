"""Merge `kdtr bench --json` files into one JSON + CSV + plot: bench_merge.py OUT.json OUT.csv OUT.png IN.json..."""
import json
import sys

from kdtr.cli import bench_commands

out_json, out_csv, out_png, *inputs = sys.argv[1:]
parts = [json.load(open(p)) for p in inputs]
merged = {"peaks": parts[0]["peaks"], "impls": parts[0]["impls"], "rows": [r for p in parts for r in p["rows"]]}
json.dump(merged, open(out_json, "w"), indent=1, default=str)
bench_commands.write_csv(out_csv, merged)
bench_commands.write_plot(out_png, merged)
