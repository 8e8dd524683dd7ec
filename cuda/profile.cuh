// profile.cuh -- loop-section profiling: the one compile switch of the kdtr kernels (-DKDTR_PROFILE).
//
// Why: a kernel's time per KV tile splits into sections (waiting for a tile, issuing a product,
// waiting for it, handing over P, ...) that no counter of ncu attributes to one role of a
// warp-specialised kernel. With -DKDTR_PROFILE each warpgroup sums the cycles of each
// section of its main loop (clock, 32 bits) and adds them, one lane per warpgroup, into kdtr_profile; without it
// every call below compiles to nothing (the shipped builds). tools/profile.py builds flash-sm90
// with the switch, runs it and prints cycles per tile.
//
// kdtr_profile slots: producer sections 0-4, consumer sections 5-9 (the first consumer warpgroup),
// tiles walked 10, CTAs 11 (PROFILE_* below; tools/profile.py reads them in this order).

#pragma once

#ifdef KDTR_PROFILE
extern "C" __device__ unsigned long long kdtr_profile[32] = {};
#endif

namespace kdtr {

constexpr int PROFILE_SECTIONS = 5;  // sections of a role's loop
constexpr int PROFILE_PRODUCER = 0, PROFILE_CONSUMER = PROFILE_PRODUCER + PROFILE_SECTIONS;
constexpr int PROFILE_TILES = PROFILE_CONSUMER + PROFILE_SECTIONS, PROFILE_CTAS = PROFILE_TILES + 1;

// One thread's section timer: start() at the loop's entry, lap(k) at the end of section k (the
// cycles since the last lap go to section k), flush() once after the loop.
struct Laps {
#ifdef KDTR_PROFILE
  // 32-bit cycle counts (a CTA's section sums stay far below 2^32; differences are wrap-safe): with 64-bit
  // ones the transposed-rows build spilled
  unsigned t = 0, sum[PROFILE_SECTIONS] = {0, 0, 0, 0, 0};
  __device__ __forceinline__ void start() { t = static_cast<unsigned>(clock()); }
  __device__ __forceinline__ void lap(int k) {
    const unsigned n = static_cast<unsigned>(clock());
    sum[k] += n - t;
    t = n;
  }
  // lane 0 of each warpgroup adds its sums at slots base..; the producer also counts tiles and CTAs
  __device__ __forceinline__ void flush(int base, int tiles) {
    if ((threadIdx.x & 127) != 0) return;
    for (int k = 0; k < PROFILE_SECTIONS; ++k) atomicAdd(&kdtr_profile[base + k], (unsigned long long)sum[k]);
    if (base == PROFILE_PRODUCER) {
      atomicAdd(&kdtr_profile[PROFILE_TILES], (unsigned long long)tiles);
      atomicAdd(&kdtr_profile[PROFILE_CTAS], 1ull);
    }
  }
#else
  __device__ __forceinline__ void start() {}
  __device__ __forceinline__ void lap(int) {}
  __device__ __forceinline__ void flush(int, int) {}
#endif
};

}  // namespace kdtr
