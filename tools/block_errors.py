"""Where a kernel goes wrong, by block: the relative error of out per 64-column block and per 16-row group,
and of lse per 16-row group, against the float64 reference on small cases (GPU needed for CUDA kernels).

    python3 tools/block_errors.py [SPEC ...]          (default: flash-sm90)
    python3 tools/block_errors.py 'flash-sm90[xr=1]' 'flash-sm90-bug=no-rope[segments=2]' flash[mt=1]

lse depends on S = Q K^T alone and out on S and P V too, so the pattern says which product (and which
warpgroup or warp: flash-sm90's consumers own columns 0-255 and 256-511, its producer warps 16 rows each)
is at fault. A diagnosis aid for kernel work, not a check: `kdtr verify` is the check.
"""

from __future__ import annotations

import argparse
import sys

CASES = (  # CaseSpec keyword arguments: fp32 out, so the kernel's own error shows, not the output's rounding
    dict(heads=64, prefix_lens=(32,), family="root", out_dtype="fp32"),
    dict(heads=64, prefix_lens=(100,), family="root", out_dtype="fp32"),
    dict(heads=16, prefix_lens=(0,), family="chain", budget=15, out_dtype="fp32"),
    dict(heads=16, prefix_lens=(100, 37), family="ddtree", budget=40, page_size=1, out_dtype="fp32"),
)


def fail(message: str) -> None:
    """Bad input: one line on stderr, exit code 2, before any kernel runs."""
    print(f"block_errors.py: {message}", file=sys.stderr)
    sys.exit(2)


def rel(a, b) -> float:
    import numpy as np

    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("specs", metavar="SPEC", nargs="*", default=["flash-sm90"], help="kernel specs (default flash-sm90)")
    args = ap.parse_args()
    from kdtr.errors import KernelSpecError
    from kdtr.kernels.registry import resolve_kernel

    try:
        kernels = [resolve_kernel(s) for s in args.specs]
    except KernelSpecError as e:
        fail(str(e))

    import numpy as np

    from kdtr.golden.reference import reference
    from kdtr.inputs.cases import CaseSpec, build_problem

    for kernel in kernels:
        for kw in CASES:
            spec = CaseSpec(**kw)
            prob, _ = build_problem(spec)
            why = kernel.caps.why_not(prob, spec.out_dtype)
            if why:
                print(f"{kernel.name} {spec.name}: skipped ({why})")
                continue
            ref_out, ref_lse = reference(prob)  # [B, T, H, 512], [B, T, H]
            res = kernel.run(prob, spec.out_dtype)
            out, ro = np.asarray(res.out, np.float64).reshape(-1, 512), ref_out.reshape(-1, 512)
            rl = ref_lse.ravel()
            lse = np.asarray(res.lse, np.float64).ravel() if res.lse is not None else np.full_like(rl, np.nan)
            print(f"{kernel.name} {spec.name}: out rel {rel(out, ro):.2e}  lse max abs {np.nanmax(np.abs(lse - rl)):.2e}  "
                  f"nan out {int(np.isnan(out).sum())}")
            print("   per 64 cols: " + " ".join(f"{rel(out[:, c:c + 64], ro[:, c:c + 64]):.1e}" for c in range(0, 512, 64)))
            R = out.shape[0]
            print("   per 16 rows (first 128): " + " ".join(f"{rel(out[r:r + 16], ro[r:r + 16]):.1e}"
                                                          for r in range(0, min(R, 128), 16)))
            print("   lse per 16 rows: " + " ".join(f"{np.abs(lse[r:r + 16] - rl[r:r + 16]).max():.1e}"
                                                   for r in range(0, min(R, 128), 16)))


if __name__ == "__main__":
    main()
