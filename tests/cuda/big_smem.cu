// big_smem.cu -- a kernel whose kdtr_launch asks for 120 KB of dynamic shared memory, for
// tests/test_build_report.py: within sm_80's 163 KB and sm_90's 227 KB, above sm_120's 99 KB, so
// `kdtr compile` must report SMEM_OVER_LIMIT on sm_120 alone. It computes nothing; never verified.
#include <cuda_bf16.h>

#include "kdtr_abi.h"

extern "C" __constant__ int kdtr_launch[4] = {1, 128, 120 * 1024, 1};

template <typename KV, typename OutT>
__global__ void big_smem_verify(const KdtrParams p) {
  extern __shared__ float buf[];
  buf[threadIdx.x] = static_cast<const float*>(p.q)[threadIdx.x];
  __syncthreads();
  static_cast<float*>(p.out)[threadIdx.x] = buf[(threadIdx.x + 1) % blockDim.x];
}
