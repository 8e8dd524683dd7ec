// Planted bug (tests/check/test_gpu_isolation.py): warp 0 writes 32 floats of shared memory that warp 1
// reads with no barrier between them, the producer -> consumer hand-off of a warp-specialised kernel
// without its "full" barrier. Silent when run plainly (the numbers are wrong anyway);
// `kdtr verify --sanitize racecheck` must report SANITIZER (a RAW hazard).
#include "kdtr_common.cuh"

template <typename KV, typename OutT>
__global__ void kdtr_test_smem_race(const KdtrParams p) {
  const int row = blockIdx.x;  // default kdtr_launch: one query row per block, 128 threads
  if (row >= p.T * p.H) return;
  __shared__ float x[32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (warp == 0) x[lane] = kdtr::to_float(static_cast<const KV*>(p.q)[(long long)row * KDTR_DK + lane]);
  float v = 0.f;
  if (warp == 1) v = x[lane];  // the planted read: nothing orders it after warp 0's write
  const long long g = (long long)blockIdx.y * p.T * p.H + row;
  if (warp == 1)
    for (int d = lane; d < KDTR_DV; d += 32) static_cast<OutT*>(p.out)[g * KDTR_DV + d] = kdtr::from_float<OutT>(v);
  if (threadIdx.x == 32) p.lse[g] = v;
}
