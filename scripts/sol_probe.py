"""Speed of light for the decode shapes: what the best bare read of the same bytes costs when timed the
way `kdtr bench` times a kernel (CUDA events, L2 flushed by reading before each repetition), as a
share of the copy peak measured in the same process. If no bare read of a shape's bytes reaches 75 %
of the copy peak, no attention kernel timed this way can (it must also read the block table and Q,
compute, write its partials and merge them). A timing aid for docs/PERF.md; nothing here is checked.

Read strategies (each over a grid of launch shapes; the table keeps each one's best):
- ``ldg``: grid-stride 16-byte loads, one in flight per thread an iteration (session 4's probe);
- ``ldg8``: each CTA a contiguous slice, 8 independent 16-byte loads in flight per thread;
- ``bulk``: each CTA a contiguous slice through cp.async.bulk (the TMA's 1-D copy) into shared memory,
  ``stages`` chunks in flight on mbarriers, one issuing thread (sm_90+).

    python3 scripts/sol_probe.py [--flush] [KERNEL ...]
      --flush   also time each read after a written flush (the L2 left dirty) beside the read flush
      KERNEL    also time these kernels on the decode shapes (default: none)
"""
import sys

import numpy as np

from kdtr.bench import run as bench
from kdtr.inputs.cases import build_problem
from kdtr.kernels.registry import resolve_kernel
from kdtr.kernels.launch import cupy_module, device_info
from kdtr.bench.timing import l2_flush_bytes, measure_peaks, time_launcher

SRC = r"""
extern "C" __global__ void empty_kernel() {}

extern "C" __global__ void read_ldg(const uint4* __restrict__ src, long long n16, unsigned* sink) {
  unsigned x = 0u;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n16; i += (long long)gridDim.x * blockDim.x) {
    const uint4 v = __ldg(src + i);
    x ^= v.x ^ v.y ^ v.z ^ v.w;  // keeps the loads alive
  }
  if (x == 0x9e3779b9u) sink[0] = x;
}

extern "C" __global__ void read_ldg8(const uint4* __restrict__ src, long long n16, unsigned* sink) {
  const long long per = (n16 + gridDim.x - 1) / gridDim.x;
  const long long lo = blockIdx.x * per, hi = min(n16, lo + per);
  unsigned x = 0u;
  for (long long i = lo + threadIdx.x; i < hi; i += 8LL * blockDim.x) {
    uint4 v[8];
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const long long j = i + (long long)u * blockDim.x;
      v[u] = j < hi ? __ldg(src + j) : make_uint4(0u, 0u, 0u, 0u);
    }
#pragma unroll
    for (int u = 0; u < 8; ++u) x ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  if (x == 0x9e3779b9u) sink[0] = x;
}

__device__ __forceinline__ unsigned smem_u32(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }

__device__ __forceinline__ void bar_wait(unsigned bar, unsigned parity) {
  asm volatile("{\n .reg .pred done;\n WAIT_%=:\n"
               " mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
               " @!done bra WAIT_%=;\n}" :: "r"(bar), "r"(parity) : "memory");
}

// buf: [stages][chunk] bytes of dynamic shared memory; one thread issues every copy of the CTA's slice
extern "C" __global__ void read_bulk(const char* __restrict__ src, long long nbytes, int chunk, int stages,
                                     unsigned* sink) {
  extern __shared__ __align__(128) char buf[];
  __shared__ __align__(8) unsigned long long bars[8];
  if (threadIdx.x != 0) return;
  const long long per = ((nbytes + gridDim.x - 1) / gridDim.x + chunk - 1) / chunk * chunk;
  const long long lo = blockIdx.x * per, hi = min(nbytes, lo + per);
  for (int s = 0; s < stages; ++s) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(smem_u32(bars + s)));
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  int k = 0;
  for (long long off = lo; off < hi; off += chunk, ++k) {
    const int s = k % stages;
    if (k >= stages) bar_wait(smem_u32(bars + s), (k / stages - 1) & 1);
    const unsigned n = (unsigned)min((long long)chunk, hi - off);
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(smem_u32(bars + s)), "r"(n) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(smem_u32(buf + (long long)s * chunk)), "l"(src + off), "r"(n), "r"(smem_u32(bars + s)) : "memory");
  }
  for (int j = max(0, k - stages); j < k; ++j) bar_wait(smem_u32(bars + j % stages), (j / stages) & 1);
  if (k > 0 && buf[0] == 0x5a && buf[1] == 0x7e) sink[0] = 1u;  // reads the data
}
"""
SIZES = (("Kimi P32k B1", 32768), ("Kimi P128k B1", 131072))
"""Decode sizes: a B1 request's prefix keys, read as prefix x 1152 bytes (its latent cache rows)."""
BUDGETS = (0, 4, 8)
"""The issue's Kimi decode trees (T = 1, 5, 9); each shape's floor counts its own bytes (bench.min_bytes: the
cache with the tree's keys, q, out, lse), at least the bare read's, so the share printed is an upper bound."""
FLOOR_SHARE = 0.75
"""The issue's memory target: a kernel at this share of the copy peak or more."""


def variants(mod, sms: int, buf, nbytes: int, sink):
    """(label, launch) of every read strategy and launch shape tried on ``nbytes`` of ``buf``."""
    ldg, ldg8, bulk = (mod.get_function(n) for n in ("read_ldg", "read_ldg8", "read_bulk"))
    n16 = nbytes // 16
    for blocks in (sms * 4, sms * 16):
        yield f"ldg grid {blocks}x512", lambda b=blocks: ldg((b,), (512,), (buf, n16, sink))
    for per_sm, threads in ((1, 1024), (2, 512), (4, 256), (8, 256)):
        b = sms * per_sm
        yield f"ldg8 grid {b}x{threads}", lambda b=b, t=threads: ldg8((b,), (t,), (buf, n16, sink))
    for per_sm, chunk, stages in ((1, 16384, 6), (1, 32768, 3), (2, 16384, 3), (2, 8192, 6), (4, 8192, 3)):
        smem = chunk * stages
        bulk.max_dynamic_shared_size_bytes = max(bulk.max_dynamic_shared_size_bytes, smem)
        b = sms * per_sm
        yield (f"bulk grid {b}, {stages} x {chunk // 1024} KB",
               lambda b=b, c=chunk, s=stages, m=smem: bulk((b,), (32,), (buf, np.int64(nbytes), np.int32(c), np.int32(s), sink),
                                                          shared_mem=m))


def main(argv: list[str]) -> None:
    cp = cupy_module()
    flush_modes = ("read", "write") if "--flush" in argv else ("read",)
    names = [a for a in argv if not a.startswith("--")]
    mod = cp.RawModule(code=SRC, options=("-std=c++17",))
    info = device_info()
    sms, flush = info["sm_count"], l2_flush_bytes(info["l2_bytes"])
    peaks = measure_peaks()
    print(f"copy peak {peaks['copy_gbs']:.0f} GB/s ({info['name']}, {sms} SMs)")
    sink = cp.zeros(1, cp.uint32)
    best = {}
    print(f"{'what':48s} {'flush':>6s} {'us':>9s} {'GB/s':>8s}")
    empty = mod.get_function("empty_kernel")
    for m in flush_modes:  # what any launch costs timed this way
        us = time_launcher(lambda: empty((sms,), (128,), ()), flush_bytes=flush, flush_mode=m)["median_ms"] * 1e3
        print(f"{'empty kernel':48s} {m:>6s} {us:9.2f}")
    for label, prefix in SIZES:
        nbytes = prefix * 1152
        buf = cp.random.randint(0, 2**31 - 1, nbytes // 4, dtype=cp.int32)
        for what, go in variants(mod, sms, buf, nbytes, sink):
            for m in flush_modes:
                us = time_launcher(go, flush_bytes=flush, flush_mode=m)["median_ms"] * 1e3
                print(f"{label + ' ' + what:48s} {m:>6s} {us:9.2f} {nbytes / us / 1e3:8.0f}")
                if m == "read" and us < best.get(prefix, (np.inf,))[0]:
                    best[prefix] = (us, what)
        buf = None  # free before the next size
    print(f"\n{'shape':36s} {'best bare read of its cache':>32s} {'us':>8s} {'floor us':>9s} {'% copy peak':>12s} "
          f"{'75 % needs us':>14s}")
    for prefix, (us, what) in best.items():
        for spec in bench.grid(["kimi-k2"], [8], list(BUDGETS), [prefix], [1]):
            floor_us = bench.min_bytes(build_problem(spec, values=False)[0], spec.out_dtype) / (peaks["copy_gbs"] * 1e3)
            print(f"{spec.name:36s} {what:>32s} {us:8.2f} {floor_us:9.2f} {100 * floor_us / us:11.1f}% "
                  f"{floor_us / FLOOR_SHARE:14.2f}")

    shapes = [("kimi-k2", b, p, 1) for b in (0, 8) for p in (32768, 131072)] + [("kimi-k2", 0, 32768, 32)]
    for name in names:
        kernel = resolve_kernel(name)
        for model, budget, prefix, batch in shapes:
            spec = bench.grid([model], [8], [budget], [prefix], [batch])[0]
            go = kernel.prepare(bench.device_problem(spec))
            for m in flush_modes:
                us = time_launcher(go, flush_bytes=flush, flush_mode=m)["median_ms"] * 1e3
                print(f"{name + ' ' + spec.name[:32]:48s} {m:>6s} {us:9.2f}")


if __name__ == "__main__":
    main(sys.argv[1:])
