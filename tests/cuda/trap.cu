// Planted fault (tests/test_gpu_isolation.py): every block executes the PTX `trap` instruction,
// which aborts the launch (an unspecified launch failure) and poisons the CUDA context.
// kdtr verify (isolated) must report RUNTIME_ERROR and carry on.
#include "kdtr_abi.h"

__global__ void kdtr_test_trap(const KdtrParams p) {
  if (threadIdx.x == 0) asm volatile("trap;");
}
