"""Compact lines from `kdtr bench --json` files: shape, impl, us, TFLOP/s, GB/s, % roofline, speedup."""
import json
import sys

for path in sys.argv[1:]:
    d = json.load(open(path))
    for r in d["rows"]:
        dims = r["dims"]
        for c in r["cells"]:
            tag = f"{dims['model'][:4]} B{dims['B']} T{dims['T']} H{dims['H']} P{dims['P']}"
            if c.get("median_ms"):
                sp = f"{c['speedup']:.1f}x" if c.get("speedup") else "-"
                print(f"{tag:32s} {c['impl']:12s} {c['median_ms'] * 1e3:10.1f} us {c['tflops']:7.1f} TF "
                      f"{c['gbs']:6.0f} GB/s {c['pct_roofline']:6.1%} {sp}")
            else:
                print(f"{tag:32s} {c['impl']:12s} {c['status'][:70]}")
