// Planted bug (tests/test_gpu_isolation.py): each block reads q[-1], the element just before the
// q allocation, and the element just past the end of the cache. Usually silent when run plainly
// (the value read is garbage, not a fault); `kdtr verify --sanitize memcheck` must report
// SANITIZER ("Invalid __global__ read").
#include "kdtr_common.cuh"

template <typename KV, typename OutT>
__global__ void kdtr_test_oob_read(const KdtrParams p) {
  const int row = blockIdx.x;  // default kdtr_launch: one query row per block
  if (row >= p.T * p.H) return;
  const KV* q = static_cast<const KV*>(p.q);
  const KV* kv = static_cast<const KV*>(p.kv_cache);
  const long long kv_elems = (long long)p.num_pages * p.page_size * KDTR_DK;
  __shared__ float x;
  if (threadIdx.x == 0) x = kdtr::to_float(q[-1]) + kdtr::to_float(kv[kv_elems]);  // the planted reads
  __syncthreads();
  const long long g = (long long)blockIdx.y * p.T * p.H + row;
  for (int d = threadIdx.x; d < KDTR_DV; d += blockDim.x)
    static_cast<OutT*>(p.out)[g * KDTR_DV + d] = kdtr::from_float<OutT>(x);
  if (threadIdx.x == 0) p.lse[g] = x;
}
