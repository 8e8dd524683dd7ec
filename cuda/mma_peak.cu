// mma_peak.cu -- the mma.sync ceiling: a pure issue loop of the instruction flash.cu's products use.
//
// What is in it
//   kdtr_mma_peak(out, iters)   every warp issues iters x CHAINS mma.sync.aligned.m16n8k16.row.col
//                               .f32.bf16.bf16.f32 (kdtr::mma_bf16: bf16 in, fp32 accumulate), then each
//                               thread writes the sum of its accumulators to out[global thread id].
//   kdtr_mma_peak_shape         {THREADS, CHAINS}: what the host multiplies the FLOPs by.
//
// Design
//   * No memory traffic in the loop: the A and B fragments are made once in registers from the thread
//     index (so nothing folds to a constant), and the CHAINS accumulators of a warp are independent, so
//     the loop is bound by the tensor cores' issue rate, not by the mma's latency: with one CTA of 32
//     warps an SM, every SM sub-partition has 8 warps x 8 chains = 64 mma in flight.
//   * One CTA of THREADS = 1024 an SM (launch bounds: <= 64 registers a thread, no spills on any arch),
//     the grid = the SM count: one wave, no tail.
//   * The checksum store after the loop keeps the accumulators live (and the asm is volatile).
//   FLOPs of a launch: grid x THREADS / 32 x CHAINS x iters x 2 * 16 * 8 * 16.
//
// How to run
//   kdtr bench --peaks      copy, bf16 GEMM and this loop in one run (kdtr/bench/timing.py, measure_mma_peak);
//                           --remeasure to measure again instead of showing the cached peaks.
//   pytest tests/bench/test_peaks.py     it compiles for sm_80 / sm_86 / sm_89 / sm_90 / sm_120 (NVRTC, no GPU)

#include <cuda_bf16.h>

#include "kdtr_common.cuh"

// ---------------------------------------------------------------------------------------------
// constants
// ---------------------------------------------------------------------------------------------
namespace mma_peak {

constexpr int THREADS = 1024;  // one CTA an SM: 32 warps, 8 a sub-partition
constexpr int CHAINS = 8;      // independent m16n8k16 accumulators a warp (32 registers)

}  // namespace mma_peak

extern "C" __constant__ int kdtr_mma_peak_shape[2] = {mma_peak::THREADS, mma_peak::CHAINS};

// ---------------------------------------------------------------------------------------------
// kernel
// ---------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(mma_peak::THREADS, 1) kdtr_mma_peak(float* out, int iters) {
  using namespace mma_peak;
  const int tid = threadIdx.x;
  const float x = 0.0625f * static_cast<float>((tid & 15) + 1), y = -0.03125f * static_cast<float>((tid >> 5) + 1);
  // the fragments: two bf16 of the thread's own values each (small, of both signs: the sums stay finite for any iters)
  const unsigned a[4] = {kdtr::pack_bf16(x, y), kdtr::pack_bf16(y, x), kdtr::pack_bf16(-x, y), kdtr::pack_bf16(x, -y)};
  const unsigned b0 = kdtr::pack_bf16(y, -x), b1 = kdtr::pack_bf16(-y, x);
  float c[CHAINS][4];
#pragma unroll
  for (int i = 0; i < CHAINS; ++i) c[i][0] = c[i][1] = c[i][2] = c[i][3] = 0.f;
#pragma unroll 2
  for (int it = 0; it < iters; ++it) {
#pragma unroll
    for (int i = 0; i < CHAINS; ++i) kdtr::mma_bf16(c[i], a, i & 1 ? b1 : b0, i & 1 ? b0 : b1);
  }
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < CHAINS; ++i) sum += (c[i][0] + c[i][1]) + (c[i][2] + c[i][3]);
  out[static_cast<long long>(blockIdx.x) * blockDim.x + tid] = sum;
}
