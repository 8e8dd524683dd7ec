// Planted for tests/kernels/test_compile_oldest_nvrtc.py: a kernel that keeps a generic lambda (an `auto`
// parameter) and calls it. NVRTC 13.5 compiles it; NVRTC 13.0 takes the lambda for host code and stops
// ("A function without execution space annotations ... is considered a host function"), as it did for a
// flash.cu loop written this way. The check that compiles every shipped build with the oldest NVRTC kdtr
// allows must fail on it.
#include "kdtr_common.cuh"

__global__ void kdtr_test_generic_lambda(float* out) {
  float acc = 0.f;
  auto step = [&](int i, auto hook) {
    acc += static_cast<float>(i);
    hook(i);
  };
  for (int i = 0; i < 4; ++i) step(i, [&](int k) { acc *= 0.5f + k; });
  out[threadIdx.x] = acc;
}
