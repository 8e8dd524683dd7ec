// Planted fault (tests/test_gpu_isolation.py): one write 1 TiB past `out`, far outside any
// allocation, so the launch ends in cudaErrorIllegalAddress and poisons the CUDA context of the
// process that ran it. kdtr verify (isolated) must report RUNTIME_ERROR and carry on.
#include "kdtr_abi.h"

__global__ void kdtr_test_oob_write(const KdtrParams p) {
  if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0)
    *reinterpret_cast<float*>(static_cast<char*>(p.out) + (1ll << 40)) = 1.0f;
}
