"""How fast do flash-sm90's wgmma chains run on the tensor pipe, alone and together? Times
scripts/wgmma_probe.cu (one CTA per SM, 384 threads) and prints multiply-adds per clock per SM
for each mode, next to the m64n256k16 chain alone (the best the pipe does here). A timing aid for
docs/PERF.md: nothing here is checked.

    python3 scripts/wgmma_probe.py [ITERS]      (sm_90 GPU)
"""
import sys
from pathlib import Path

from kdtr.kernels.launch import cupy_module, device_info, load_function

cp = cupy_module()
SRC = Path(__file__).with_name("wgmma_probe.cu")
MODES = {
    0: ("S: 36 x m64n32k16, one accumulator", {0: 36 * 64 * 32 * 16}),
    1: ("S: 36 x m64n32k16, two accumulators", {0: 36 * 64 * 32 * 16}),
    2: ("S64: 36 x m64n64k16, one accumulator", {0: 36 * 64 * 64 * 16}),
    3: ("P V: 2 x m64n256k16 on two warpgroups", {1: 2 * 64 * 256 * 16, 2: 2 * 64 * 256 * 16}),
    4: ("S (one acc) + P V together", {0: 36 * 64 * 32 * 16, 1: 2 * 64 * 256 * 16, 2: 2 * 64 * 256 * 16}),
    5: ("S (two acc) + P V together", {0: 36 * 64 * 32 * 16, 1: 2 * 64 * 256 * 16, 2: 2 * 64 * 256 * 16}),
    6: ("S: 2 halves x 36 x m64n16k16", {0: 36 * 64 * 32 * 16}),
    7: ("S (2 halves n16) + P V together", {0: 36 * 64 * 32 * 16, 1: 2 * 64 * 256 * 16, 2: 2 * 64 * 256 * 16}),
}
iters = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
sms = device_info()["sm_count"]
cycles = cp.zeros(sms * 3, cp.int64)
sink = cp.zeros(384, cp.float32)
print(f"{'mode':44s} {'cycles/iter (wg0 wg1 wg2)':>30s} {'FMA/clk/SM':>11s}")
for mode, (label, fmas) in MODES.items():
    fn = load_function(SRC, f"wgmma_probe<{mode}>", arch="sm_90a")
    smem = 92240
    fn.function.max_dynamic_shared_size_bytes = smem
    for _ in range(2):  # the first launch warms the clocks
        fn.function((sms,), (384,), (cycles, sink, cp.int32(iters)), shared_mem=smem)
    cp.cuda.runtime.deviceSynchronize()
    c = cycles.get().reshape(sms, 3)
    per_iter = [float(c[:, w].mean()) / iters for w in range(3)]
    span = max(per_iter[w] for w in fmas)
    print(f"{label:44s} {' '.join(f'{x:9.1f}' for x in per_iter):>30s} {sum(fmas.values()) / span:11.0f}")
