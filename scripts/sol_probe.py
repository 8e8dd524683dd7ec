"""Speed of light for the decode shapes: what a bare streaming read of the same bytes costs when
timed the way `kdtr bench` times a kernel (CUDA events, L2 flushed before each repetition), and how
much of it is the flush itself (a written flush leaves the L2 full of dirty lines that the timed
kernel must write back; a read flush leaves it clean). A timing aid for docs/PERF.md; nothing here
is checked.

    python3 scripts/sol_probe.py [KERNEL ...]      (default flash-sm90)
"""
import sys

from kdtr import bench
from kdtr.kernels import resolve_kernel
from kdtr.launch import _cupy, device_info
from kdtr.timing import l2_flush_bytes, time_launcher

cp = _cupy()
SRC = r"""
extern "C" __global__ void empty_kernel() {}
// every thread streams 16-byte words, grid-stride; the xor only keeps the loads alive
extern "C" __global__ void read_kernel(const uint4* __restrict__ src, long long n16, unsigned* sink) {
  unsigned x = 0u;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n16; i += (long long)gridDim.x * blockDim.x) {
    const uint4 v = __ldg(src + i);
    x ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (x == 0x9e3779b9u) sink[0] = x;
}
"""
mod = cp.RawModule(code=SRC)
empty, read = mod.get_function("empty_kernel"), mod.get_function("read_kernel")
sms = device_info()["sm_count"]
FLUSH = l2_flush_bytes(device_info()["l2_bytes"])
sink = cp.zeros(1, cp.uint32)

print(f"{'what':44s} {'flush':>6s} {'us':>9s} {'GB/s':>8s}")
t = {m: time_launcher(lambda: empty((sms,), (128,), ()), flush_bytes=FLUSH, flush_mode=m)["median_ms"] * 1e3
     for m in ("write", "read")}
for m, v in t.items():
    print(f"{'empty kernel':44s} {m:>6s} {v:9.2f}")
for label, nbytes in (("Kimi P32k B1 (32k x 1152 B)", 32768 * 1152), ("Kimi P128k B1", 131072 * 1152),
                      ("Kimi P32k B32", 32 * 32768 * 1152), ("Kimi P128k B32", 32 * 131072 * 1152)):
    buf = cp.random.randint(0, 2**31 - 1, nbytes // 4, dtype=cp.int32)
    for blocks in (sms * 4, sms * 16):
        for m in ("write", "read"):
            us = time_launcher(lambda: read((blocks,), (512,), (buf, nbytes // 16, sink)), flush_bytes=FLUSH,
                               flush_mode=m)["median_ms"] * 1e3
            print(f"{'read ' + label + f' grid {blocks}':44s} {m:>6s} {us:9.2f} {nbytes / us / 1e3:8.0f}")
    buf = None  # free before the next size

names = sys.argv[1:] or ["flash-sm90"]
shapes = [("kimi-k2", b, p, 1) for b in (0, 8) for p in (32768, 131072)] + [("kimi-k2", 0, 32768, 32)] + \
         [("deepseek-v3", 64, 8192, 1), ("deepseek-v3", 256, 8192, 1)]
for name in names:
    kernel = resolve_kernel(name)
    for model, budget, prefix, batch in shapes:
        spec = bench.grid([model], [8], [budget], [prefix], [batch])[0]
        dp = bench.device_problem(spec)
        go = kernel.prepare(dp)
        for m in ("write", "read"):
            us = time_launcher(go, flush_bytes=FLUSH, flush_mode=m)["median_ms"] * 1e3
            print(f"{name + ' ' + spec.name[:32]:44s} {m:>6s} {us:9.2f}")
