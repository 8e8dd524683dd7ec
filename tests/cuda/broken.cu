// broken.cu -- a kernel that does not compile, for tests/test_cli.py: `kdtr verify -k
// tests/cuda/broken.cu:broken` must end in one line naming the compiler error and exit code 2.
#include "kdtr_abi.h"
extern "C" __global__ void broken(const KdtrParams p) { this is not C++; }
