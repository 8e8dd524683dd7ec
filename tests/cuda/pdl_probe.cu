// Dependent-launch probe (tests/test_gpu_verify.py): the primary releases its dependents at once,
// then spins for spin_ns of globaltimer before raising a flag; the secondary copies the flag it
// sees, after kdtr::pdl_wait() or not. Launched dependent without the wait it must see 0 (it ran
// early: the launch does overlap), with the wait 1 (the wait orders it), as must a plain launch.
#include "kdtr_common.cuh"

__device__ __forceinline__ long long now_ns() {
  long long t;
  asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
  return t;
}

__global__ void kdtr_pdl_primary(unsigned* flag, long long spin_ns) {
  kdtr::pdl_launch_dependents();
  const long long t0 = now_ns();
  while (now_ns() - t0 < spin_ns) {
  }
  *flag = 1u;
}

__global__ void kdtr_pdl_secondary(const unsigned* flag, unsigned* seen, int wait) {
  if (wait) kdtr::pdl_wait();
  *seen = *static_cast<volatile const unsigned*>(flag);
}
