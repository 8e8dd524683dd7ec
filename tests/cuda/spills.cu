// spills.cu -- a kernel that spills on sm_80 / sm_90, for tests/test_build_report.py: 48 live fp32
// accumulators under __launch_bounds__(1024, 2), i.e. 32 registers a thread. `kdtr compile` must
// report SPILLS with ptxas's byte counts and exit 1. It computes nothing meaningful; never verified.
#include <cuda_bf16.h>

#include "kdtr_abi.h"

extern "C" __constant__ int kdtr_launch[4] = {1, 128, 0, 1};

template <typename KV, typename OutT>
__global__ void __launch_bounds__(1024, 2) spills_verify(const KdtrParams p) {
  const float* q = static_cast<const float*>(p.q);
  float acc[48];
#pragma unroll
  for (int i = 0; i < 48; ++i) acc[i] = q[threadIdx.x * 48 + i];
  for (int k = 0; k < p.T; ++k) {
#pragma unroll
    for (int i = 0; i < 48; ++i) acc[i] = acc[i] * acc[(i + 7) % 48] + q[k * 48 + i];
  }
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 48; ++i) s += acc[i];
  static_cast<float*>(p.out)[threadIdx.x] = s;
}
