"""What bounds the first load batch of flash-sm90's in-kernel merge? (docs/PERF.md, session 12)

The profile build says the merge's first batch of partial loads takes 1.6-3.2 us on Kimi T1
P128k B1 however few bytes a merger reads. This probe rebuilds that step alone, shaped like
kdtr::merge_row for T1 B1 (129 splits of 8 rows x 512 fp32 columns; the last 32 CTAs to take a
ticket merge one 128-column unit each, 8 warps x 17 float4 + 17 lse loads a lane in flight), and
times the batch in SM cycles (clock64) per merger, reading partials that were
  fresh    : written by the other CTAs of this launch (as in the kernel),
  fresh+5us: the same, the mergers waiting 5 us after the last arrival before loading,
  resident : written by the previous launch (in L2, not just written),
  cold     : written by the previous launch, then L2 emptied by reading 2x its size,
with 17 or 4 loads a lane in flight. A timing aid for docs/PERF.md: nothing here is checked.

    python3 scripts/merge_probe.py        (any CUDA GPU)
"""
import numpy as np

from kdtr.kernels.launch import cupy_module, device_info

cp = cupy_module()
S, R, DV, MERGERS, THREADS = 129, 8, 512, 32, 256
SRC = r"""
template <int BATCH>
__global__ void __launch_bounds__(256) merge_probe(float* parts, float* lse, unsigned* ctr, long long* cyc,
                                                   float* out, int S, int mergers, int write, long long delay) {
  __shared__ unsigned ticket;
  __shared__ float red[8];
  const int R = 8, DV = 512, t = threadIdx.x, warp = t / 32, lane = t % 32, s = blockIdx.x;
  if (write) {  // this split's partial rows (8 x 512 floats: 4 float4 a thread) and lse
    for (int i = t; i < R * DV / 4; i += 256)
      reinterpret_cast<float4*>(parts + (long long)s * R * DV)[i] = make_float4(s, i, 1.f, 2.f);
    if (t < R) lse[s * R + t] = 0.001f * s + t;
  }
  __threadfence();
  __syncthreads();
  if (t == 0) ticket = atomicAdd(ctr, 1u);
  __syncthreads();
  const int rank = (int)ticket - (S - mergers);
  if (rank < 0) return;
  if (t == 0) {
    unsigned n;
    do { asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(n) : "l"(ctr) : "memory"); } while (n < (unsigned)S);
  }
  __syncthreads();
  const long long w0 = clock64();
  while (clock64() - w0 < delay) {}
  __syncthreads();
  const long long c0 = clock64();
  const int row = rank / 4, c4 = (rank % 4) * 32 + lane;  // unit: row, 128-column group
  __shared__ float mx[8];
  float ls[BATCH];
  float4 x[BATCH];
  float acc = 0.f, M = -1e30f;
  for (int s0 = warp; s0 < S; s0 += 8 * BATCH) {  // as kdtr::merge_row: every load of a step, then the max
#pragma unroll
    for (int k = 0; k < BATCH; ++k) {
      const int sk = min(s0 + 8 * k, S - 1);
      ls[k] = lse[sk * R + row];
      x[k] = reinterpret_cast<const float4*>(parts + ((long long)sk * R + row) * DV)[c4];
    }
    float m = M;
#pragma unroll
    for (int k = 0; k < BATCH; ++k) m = fmaxf(m, ls[k]);
    for (int o = 16; o; o /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (lane == 0) mx[warp] = m;
    __syncthreads();  // the block's max (merge_row's sync): the partial loads stay ahead of it
#pragma unroll
    for (int w = 0; w < 8; ++w) m = fmaxf(m, mx[w]);
    __syncthreads();
    acc *= exp2f(M - m);
    M = m;
#pragma unroll
    for (int k = 0; k < BATCH; ++k) acc += exp2f(ls[k] - M) * (x[k].x + x[k].y + x[k].z + x[k].w);
  }
  for (int o = 16; o; o /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  if (lane == 0) red[warp] = acc + M;
  __syncthreads();
  const long long c1 = clock64();
  if (t == 0) {
    float sum = 0.f;
    for (int w = 0; w < 8; ++w) sum += red[w];
    out[rank] = sum;
    cyc[rank] = c1 - c0;
  }
}
"""
mod = cp.RawModule(code=SRC, options=("-std=c++17",), name_expressions=("merge_probe<17>", "merge_probe<4>"))
parts = cp.zeros(S * R * DV, cp.float32)
lse = cp.zeros(S * R, cp.float32)
ctr = cp.zeros(1, cp.uint32)
cyc = cp.zeros(MERGERS, cp.int64)
out = cp.zeros(MERGERS, cp.float32)
flush = cp.zeros(2 * device_info()["l2_bytes"] // 4, cp.float32)
mhz = cp.cuda.runtime.getDeviceProperties(0)["clockRate"] / 1e3


def launch(batch: int, write: bool, delay_cycles: int = 0) -> np.ndarray:
    ctr.fill(0)
    fn = mod.get_function(f"merge_probe<{batch}>")
    fn((S,), (THREADS,), (parts, lse, ctr, cyc, out, np.int32(S), np.int32(MERGERS), np.int32(write),
                          np.int64(delay_cycles)))
    cp.cuda.runtime.deviceSynchronize()
    return cyc.get()


print(f"{S} splits x {R} rows x {DV} fp32, {MERGERS} mergers of 128 columns; SM clock {mhz:.0f} MHz")
print(f"{'mode':12s} {'batch':>5s} {'median cycles':>14s} {'max cycles':>11s} {'max us':>7s}")
for batch in (17, 4):
    for mode in ("fresh", "fresh+5us", "resident", "cold"):
        runs = []
        for _ in range(7):
            if mode in ("resident", "cold"):
                launch(batch, True)
                if mode == "cold":
                    float(flush.sum())  # read 2x L2: the partials leave it
            runs.append(launch(batch, mode != "resident" and mode != "cold", int(5 * mhz) if mode == "fresh+5us" else 0))
        c = np.median(np.stack(runs), axis=0)  # per merger, the median launch
        print(f"{mode:12s} {batch:5d} {np.median(c):14.0f} {c.max():11.0f} {c.max() / mhz:7.2f}")
