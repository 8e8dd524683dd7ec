"""Where a flash kernel goes wrong, by block: relative error of out per 64-column block and per
16-row group, and of lse, against the float64 reference on small cases (GPU needed).

    python3 scripts/sm90_debug.py [KERNEL | LABEL=NVRTC-OPTS ...]   (default: flash-sm90)

LABEL=OPTS builds flash-sm90 with those options (its -D experiment knobs), e.g. notma=-DKDTR_F90_NO_TMA.

lse depends on S = Q K^T alone and out on S and P V too, so the pattern says which product (and
which warpgroup / warp) is at fault. A diagnosis aid for kernel work, not a check.
"""
import sys

import numpy as np

from kdtr.inputs.cases import CaseSpec, build_problem
from kdtr.kernels import registry as kernels
from kdtr.kernels.registry import resolve_kernel
from kdtr.golden.reference import reference

CASES = [
    CaseSpec(heads=64, prefix_lens=(32,), family="root", out_dtype="fp32"),
    CaseSpec(heads=64, prefix_lens=(100,), family="root", out_dtype="fp32"),
    CaseSpec(heads=16, prefix_lens=(0,), family="chain", budget=15, out_dtype="fp32"),
    CaseSpec(heads=16, prefix_lens=(100, 37), family="ddtree", budget=40, page_size=1, out_dtype="fp32"),
]


def rel(a, b):
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


for name in sys.argv[1:] or ["flash-sm90"]:
    if "=" in name and not name.split("=")[0].endswith("-bug"):
        label, opts = name.split("=", 1)
        k = kernels.flash90_build(label, opts)
    else:
        k = resolve_kernel(name)
    for spec in CASES:
        prob, _ = build_problem(spec)
        ref_out, ref_lse = reference(prob)  # [B, T, H, 512], [B, T, H]
        res = k.run(prob, "fp32")
        out = np.asarray(res.out, np.float64).reshape(-1, 512)
        ro = ref_out.reshape(-1, 512)
        lse = np.asarray(res.lse, np.float64).ravel()
        rl = ref_lse.ravel()
        print(f"{name} {spec.name}: out rel {rel(out, ro):.2e}  lse max abs {np.nanmax(np.abs(lse - rl)):.2e}  "
              f"nan out {int(np.isnan(out).sum())}")
        cols = " ".join(f"{rel(out[:, c:c + 64], ro[:, c:c + 64]):.1e}" for c in range(0, 512, 64))
        print(f"   per 64 cols: {cols}")
        R = out.shape[0]
        rows = " ".join(f"{rel(out[r:r + 16], ro[r:r + 16]):.1e}" for r in range(0, min(R, 128), 16))
        print(f"   per 16 rows (first 128): {rows}")
        lrows = " ".join(f"{np.abs(lse[r:r + 16] - rl[r:r + 16]).max():.1e}" for r in range(0, min(R, 128), 16))
        print(f"   lse per 16 rows: {lrows}")
