"""Are flash-sm90's builds byte-identical from one compile to the next on this machine? Compiles the shipped
main, XR_ONLY and narrow-merge builds fresh (no cache) several times, with and without an unused -D, and prints
each cubin's md5 (docs/PERF.md, session 20: builds of the same code timed 1-2 us apart on Kimi decode).

    python3 scripts/build_hashes.py [N]
"""
import hashlib
import sys

from kdtr.kernels import registry as kernels, nvrtc

NAMES = ["kdtr_flash90_verify<__nv_bfloat16, 0, 0, 0>", "kdtr_flash90_verify<__nv_bfloat16, 0, 1, 0>",
         "kdtr_flash90_verify<__nv_bfloat16, 0, 0, 1>", "kdtr_flash_combine_narrow<__nv_bfloat16, 64, 4>"]
n = int(sys.argv[1]) if len(sys.argv) > 1 else 3
print("NVRTC", nvrtc.version())
for name in NAMES:
    hashes = []
    for k in range(n):
        opts = ("-DKDTR_NOOP=1",) if k == n - 1 else ()
        c = nvrtc.compile_file(kernels.flash.SM90.source, [name], "sm_90a", cache=False, options=opts)
        hashes.append(hashlib.md5(c.cubin).hexdigest()[:10])
    print(f"{name:52s} {' '.join(hashes)}  (last: -DKDTR_NOOP=1)")
