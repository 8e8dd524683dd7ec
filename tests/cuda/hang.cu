// Planted fault (tests/test_gpu_isolation.py): every thread spins on a volatile flag nobody sets,
// so the launch never finishes. kdtr verify (isolated) must kill the child after --timeout and
// report TIMEOUT.
#include "kdtr_abi.h"

__device__ volatile int kdtr_test_release = 0;  // never written: volatile forces a reload each turn

__global__ void kdtr_test_hang(const KdtrParams p) {
  while (kdtr_test_release == 0) {
  }
}
