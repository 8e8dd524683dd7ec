// flash_sched.cuh -- the device half of a flash launch plan: what depends on the prefix lengths is decided here,
// on the GPU, at every launch, so that a launch captured in a CUDA graph at dummy lengths stays right and fast
// when a server replays it at the real ones (docs/KERNELS.md, "Graph safety").
//
// What is in it
//   struct FlashSched            the plan's device half, passed by value beside KdtrParams to every flash kernel
//                                (kdtr/kernels/flash/device_plan.py packs it; a test keeps the two equal)
//   kdtr::request_splits         a request's KV split count: its entry in the plan's split table
//   kdtr::block_exclusive_scan   a prefix sum over one CTA (the scheduler's)
// The scheduler itself, kdtr_flash_schedule, is in flash_schedule.cuh (flash-sm90 only).
//
// The host plan (kdtr/kernels/flash/plan.py) depends on shapes and a capacity only. Uniform plans launch the grid
// (row tiles, the capacity's split count, B); each CTA looks its request's split count up in `splits` (the cost
// model tabulated over every prefix tile count up to the capacity) and a CTA past it exits at once; the merges
// read the same entry. Work-table plans launch max_pieces CTAs after kdtr_flash_schedule; CTAs past the
// table's piece count exit at once.
//
// How to run: through the flash kernels (`kdtr verify -k flash-sm90 ci --graph`); tests/kernels/test_gpu_sched.py
// compares the device tables with kdtr/kernels/flash/schedule.py's mirror bit for bit.

#pragma once

#include "kdtr_abi.h"
#include "kdtr_common.cuh"

namespace kdtr {
// A work table row (kdtr/kernels/flash/schedule.py WORK_FIELDS): request, row tile, prefix keys [lo, hi), tail, slot.
constexpr int WORK_INTS = 6;
// A combine job row (kdtr/kernels/flash/schedule.py JOB_FIELDS): request, first row, first slot, slots.
constexpr int JOB_INTS = 4;
}  // namespace kdtr

struct FlashSched {
  const int* splits;  // [tiles_cap + 1] KV splits of a request of n prefix tiles (entry min(n, tiles_cap))
  long long table_offset;  // bytes from p.workspace to the work-table region, int [SCHED_HEADER + max_pieces *
                           //   WORK_INTS + max_jobs * JOB_INTS + max_pieces * SCHED_SCRATCH]: header, work rows, job
                           //   rows, scratch, rewritten by kdtr_flash_schedule at every launch; -1: a uniform plan
  int tiles_cap;      // last index of splits
  int tile_shift;     // log2 of the keys a tile of `splits` counts (the kernel's BN)
  int max_pieces;     // work rows the table holds: the work-table grid
  int max_jobs;       // job rows it holds: B * row_tiles
  int family;         // the recipe (enum SchedFamily)
  int target;         // ALIGNED, WHOLE: CTAs the aligned cut aims at; STREAM: parts of the total work
  int interval;       // STREAM: tiles between cuts instead (0: total / target)
  int whole;          // WHOLE: jobs walked whole, longest first
  int row_tiles;      // row tiles of a request: jobs are (request, row tile)
  int rows_per_tile;  // query rows of a row tile (a job row's first row is rt * rows_per_tile)
};

enum SchedFamily : int { SCHED_ALIGNED = 0, SCHED_WHOLE = 1, SCHED_STREAM = 2 };  // schedule.py Family

constexpr int SCHED_THREADS = 1024;     // kdtr_flash_schedule's one CTA
constexpr int SCHED_MAX_PIECES = 4096;  // pieces it sorts (plan.py MAX_TABLE_PIECES)
constexpr int SCHED_MAX_JOBS = 4096;    // (request, row tile) jobs (plan.py MAX_TABLE_JOBS)
constexpr int SCHED_HEADER = 4;         // ints before the work rows: pieces, cut jobs, 2 spare
constexpr int SCHED_SCRATCH = 5;        // ints of a piece in list order: job, first tile, end tile, tail, slot
constexpr int SCHED_MAX_SPLITS = 256;   // splits of one request (schedule.py MAX_PIECES)
// kdtr_flash_schedule's dynamic shared memory: the sort keys, 6 arrays over requests and 3 over jobs, scan scratch
constexpr int SCHED_SMEM_BYTES = SCHED_MAX_PIECES * 8 + 9 * SCHED_MAX_JOBS * 4 + (SCHED_THREADS / 32 + 1) * 4;

namespace kdtr {

// KV splits of a request of P prefix keys: its entry in the plan's split table.
__device__ __forceinline__ int request_splits(const FlashSched& s, int P) {
  return s.splits[min((P + (1 << s.tile_shift) - 1) >> s.tile_shift, s.tiles_cap)];
}

// Where kdtr_flash_schedule leaves the tables (flash_split.cuh's work_table_row and kdtr_flash_combine_jobs read them):
// the header (pieces, cut jobs), then the work rows, then the job rows.
__device__ __forceinline__ int* sched_table(const KdtrParams& p, const FlashSched& s) {
  return reinterpret_cast<int*>(static_cast<char*>(p.workspace) + s.table_offset);
}
__device__ __forceinline__ const int* sched_work(const KdtrParams& p, const FlashSched& s) {
  return sched_table(p, s) + SCHED_HEADER;
}
__device__ __forceinline__ const int* sched_jobs(const KdtrParams& p, const FlashSched& s) {
  return sched_table(p, s) + SCHED_HEADER + (long long)s.max_pieces * WORK_INTS;
}

// Exclusive prefix sum of a[0 .. n) in place (n <= 4 * SCHED_THREADS); returns the total. Every thread of the
// CTA calls it; `part` is SCHED_THREADS / 32 + 1 ints of scratch.
__device__ __forceinline__ int block_exclusive_scan(int* a, int n, int* part) {
  constexpr int PER = 4;
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  int v[PER], sum = 0;
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    const int k = t * PER + i;
    v[i] = k < n ? a[k] : 0;
    sum += v[i];
  }
  int incl = sum;  // inclusive scan of the per-thread sums: within a warp, then over the warps
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const int x = __shfl_up_sync(0xffffffffu, incl, off);
    if (lane >= off) incl += x;
  }
  if (lane == 31) part[warp] = incl;
  __syncthreads();
  if (warp == 0) {
    int w = lane < SCHED_THREADS / 32 ? part[lane] : 0;
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
      const int x = __shfl_up_sync(0xffffffffu, w, off);
      if (lane >= off) w += x;
    }
    part[lane] = w;  // inclusive over warps 0 .. lane
    if (lane == 31) part[SCHED_THREADS / 32] = w;
  }
  __syncthreads();
  int run = incl - sum + (warp ? part[warp - 1] : 0);
  const int total = part[SCHED_THREADS / 32];
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    const int k = t * PER + i;
    if (k < n) a[k] = run;
    run += v[i];
  }
  __syncthreads();
  return total;
}

}  // namespace kdtr
