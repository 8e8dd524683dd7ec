// flash_schedule.cuh -- kdtr_flash_schedule, flash-sm90's device scheduler (the plan's device half is in
// flash_sched.cuh): one CTA turns the recipe the host chose at the plan's capacity (kdtr/kernels/flash/schedule.py
// Recipe) into the work and job tables for this launch's prefix lengths, in the workspace, before the main kernel
// (launched dependent on it) reads them.
//
// How to run: through flash-sm90's work-table plans (`kdtr verify -k "flash-sm90[segments=1]" ci --graph`);
// tests/kernels/test_gpu_sched.py compares its tables with kdtr/kernels/flash/schedule.py's mirror bit for bit.

#pragma once

#include "flash_sched.cuh"
#include "flash_split.cuh"

namespace kdtr {

// The scheduler's view of every job once its per-request pass is done (arrays in shared memory, [B] each but
// `first`, [jobs]): a job's pieces in list order, and where each sits in the host's list before sorting.
struct SchedJobs {
  const int* pre;    // prefix tiles of request b
  const int* work;   // its job's tiles (prefix + tail)
  const int* rank;   // WHOLE: its place by size, its split count << 16; ALIGNED: the split count << 16; STREAM:
                     //   the tiles of the requests before it, for one row tile
  const int* rest;   // its jobs not walked whole
  const int* kept;   // its pieces a job in the aligned cut
  const int* off;    // list index of its first aligned piece (after the whole jobs)
  const int* first;  // STREAM: list index of job j's first piece
  int RT, B, family, interval, target, whole_jobs;

  // fn(idx, first tile, end tile, tail) for each piece of job j, in list order; returns how many.
  template <typename Fn>
  __device__ __forceinline__ int pieces(int j, Fn fn) const {
    const int b = j / RT, rt = j - b * RT;
    if (family == SCHED_STREAM) {
      const long long W = (long long)RT * (rank[B - 1] + work[B - 1]);  // rank: the exclusive scan of work
      const long long pos = (long long)RT * rank[b] + (long long)rt * work[b];
      long long k = interval ? pos / interval + 1 : ((pos + 1) * target + W - 1) / W;  // the first cut past pos
      int lo = 0, n = 0;
      for (;; ++k) {
        const long long cut = interval ? k * interval : k * W / target;
        if (cut >= pos + work[b]) break;
        const int c = (int)min(cut - pos, (long long)pre[b]);  // a cut inside the tail moves to its start
        if (c > lo) {
          fn(n++, lo, c, false);
          lo = c;
        }
      }
      fn(n++, lo, pre[b], true);
      return n;
    }
    if (rt < RT - rest[b]) {  // WHOLE's head: one piece walks the whole job
      fn(0, 0, pre[b], true);
      return 1;
    }
    const int splits = rank[b] >> 16, L = max(1, (work[b] + splits - 1) / splits);
    for (int i = 0; i < kept[b]; ++i) {
      const int sp = i < kept[b] - 1 ? i : splits - 1;  // the kept non-last splits, then the last
      const int lo = min(pre[b], sp * L);
      const bool last = sp == splits - 1;
      fn(i, lo, last ? pre[b] : min(pre[b], lo + L), last);
    }
    return kept[b];
  }

  // The list index of piece idx of job j (the host's order before sorting).
  __device__ __forceinline__ int list_index(int j, int idx) const {
    const int b = j / RT, rt = j - b * RT, head = RT - rest[b];
    if (family == SCHED_STREAM) return first[j] + idx;
    if (rt < head) return (rank[b] & 0xFFFF) * RT + rt;
    return whole_jobs + off[b] + idx * rest[b] + (rt - head);
  }
};

}  // namespace kdtr

// One CTA of SCHED_THREADS: the work table of this launch from the device's prefix lengths, as
// kdtr/kernels/flash/schedule.py's recipe_pieces, longest_first and Schedule.tables make it on the host (the same
// integer arithmetic, so the two agree bit for bit). Jobs are (request, row tile), j = b * row_tiles + rt; a piece
// is a range of a job's prefix tiles, the last piece of a job also walks the tree tail. Steps: each request's
// tiles; each job's piece count and, by prefix sums, its place in the list, its partial slots and its job row;
// each piece into the scratch rows in list order with its sort key (tiles descending, list index); a bitonic sort;
// the work rows in that order. The main kernel is launched dependent on this one and waits for it.
__global__ void __launch_bounds__(SCHED_THREADS) kdtr_flash_schedule(const KdtrParams p, const FlashSched s) {
  extern __shared__ __align__(16) unsigned char sched_smem[];
  kdtr::pdl_launch_dependents();  // the main kernel's CTAs may start; they wait for this grid to finish
  const int t = threadIdx.x, B = p.B, RT = s.row_tiles, J = B * RT;
  const int bn = 1 << s.tile_shift, tt = (p.T + bn - 1) / bn;
  if (J > SCHED_MAX_JOBS || J > s.max_jobs) __trap();  // the host plan never asks this (plan.py)

  unsigned long long* keys = reinterpret_cast<unsigned long long*>(sched_smem);  // [SCHED_MAX_PIECES]
  int* pre = reinterpret_cast<int*>(keys + SCHED_MAX_PIECES);  // [B] prefix tiles of request b
  int* work = pre + SCHED_MAX_JOBS;     // [B] its job's tiles (prefix + tail)
  int* rank = work + SCHED_MAX_JOBS;    // [B] WHOLE: its place by size; STREAM: tiles of requests before it
  int* rest = rank + SCHED_MAX_JOBS;    // [B] its jobs not walked whole (ALIGNED: all)
  int* kept = rest + SCHED_MAX_JOBS;    // [B] its pieces per job in the aligned cut
  int* off = kept + SCHED_MAX_JOBS;     // [B] list index of its first aligned piece
  int* cnt = off + SCHED_MAX_JOBS;      // [J] pieces of job j, then its first list index (STREAM)
  int* slot0 = cnt + SCHED_MAX_JOBS;    // [J] its first partial slot (cut jobs)
  int* jrow = slot0 + SCHED_MAX_JOBS;   // [J] its job row (cut jobs)
  int* part = jrow + SCHED_MAX_JOBS;    // scan scratch
  __shared__ long long total_s;

  const int* P = p.prefix_lens;
  for (int b = t; b < B; b += SCHED_THREADS) {
    pre[b] = (P[b] + bn - 1) / bn;
    work[b] = pre[b] + tt;
  }
  if (t == 0) total_s = 0;
  __syncthreads();
  const int family = s.family;
  if (family == SCHED_STREAM) {
    for (int b = t; b < B; b += SCHED_THREADS) rank[b] = work[b];
    __syncthreads();
    kdtr::block_exclusive_scan(rank, B, part);  // rank[b]: the tiles of requests before b's row tile 0, / RT
  } else {
    for (int b = t; b < B; b += SCHED_THREADS) {
      int r = 0;
      if (family == SCHED_WHOLE)
        for (int c = 0; c < B; ++c) r += work[c] > work[b] || (work[c] == work[b] && c < b);
      rank[b] = r;
      const int head = family == SCHED_WHOLE ? min(RT, max(0, s.whole - r * RT)) : 0;
      rest[b] = RT - head;
      atomicAdd(reinterpret_cast<unsigned long long*>(&total_s), (unsigned long long)rest[b] * work[b]);
    }
    __syncthreads();
    const long long total = total_s;
    for (int b = t; b < B; b += SCHED_THREADS) {
      int k = 0, splits = 0;
      if (rest[b] > 0) {
        splits = (int)max(1LL, min((long long)min(SCHED_MAX_SPLITS, work[b]),
                                   (2LL * s.target * work[b] + total) / (2 * total)));
        const int L = max(1, (work[b] + splits - 1) / splits);
        k = min(splits - 1, (pre[b] + L - 1) / L) + 1;
      }
      kept[b] = k;
      off[b] = rest[b] * k;
      rank[b] |= splits << 16;  // WHOLE: rank < 4096; the split count beside it
    }
    __syncthreads();
    kdtr::block_exclusive_scan(off, B, part);
  }
  const int whole_jobs = family == SCHED_WHOLE ? s.whole : 0;

  const kdtr::SchedJobs jobs{pre, work, rank, rest, kept, off, cnt, RT, B, family, s.interval, s.target, whole_jobs};
  for (int j = t; j < J; j += SCHED_THREADS) {
    const int n = jobs.pieces(j, [](int, int, int, bool) {});
    cnt[j] = n;
    slot0[j] = n > 1 ? n : 0;
    jrow[j] = n > 1;
  }
  __syncthreads();
  const int n_slots = kdtr::block_exclusive_scan(slot0, J, part);
  const int n_jobs = kdtr::block_exclusive_scan(jrow, J, part);
  const int n_pieces = kdtr::block_exclusive_scan(cnt, J, part);  // cnt[j]: the job's first list index (STREAM's)
  if (n_pieces > s.max_pieces || n_pieces > SCHED_MAX_PIECES || n_slots > s.max_pieces) __trap();  // see plan.py

  int* table = kdtr::sched_table(p, s);
  int* jobs_out = table + SCHED_HEADER + (long long)s.max_pieces * kdtr::WORK_INTS;
  int* scratch = jobs_out + (long long)s.max_jobs * kdtr::JOB_INTS;
  for (int j = t; j < J; j += SCHED_THREADS) {
    const int b = j / RT, rt = j - b * RT;
    const int s0 = slot0[j];
    const int n = jobs.pieces(j, [&](int idx, int lo, int hi, bool tail) {
      const int li = jobs.list_index(j, idx);
      const int tiles = hi - lo + (tail ? tt : 0);
      int* sc = scratch + (long long)li * SCHED_SCRATCH;
      sc[0] = j;
      sc[1] = lo;
      sc[2] = hi;
      sc[3] = tail;
      sc[4] = -1;
      keys[li] = ((unsigned long long)(0xFFFFFFFFu - (unsigned)tiles) << 32) | (unsigned)li;
    });
    if (n > 1) {
      // slots in the job's piece order (increasing first tile): the scratch rows get them
      jobs.pieces(j, [&](int idx, int, int, bool) { scratch[(long long)jobs.list_index(j, idx) * SCHED_SCRATCH + 4] = s0 + idx; });
      int* jr = jobs_out + (long long)jrow[j] * kdtr::JOB_INTS;
      jr[0] = b;
      jr[1] = rt * s.rows_per_tile;
      jr[2] = s0;
      jr[3] = n;
    }
  }
  int n2 = 1;
  while (n2 < n_pieces) n2 <<= 1;
  for (int i = n_pieces + t; i < n2; i += SCHED_THREADS) keys[i] = ~0ull;
  __syncthreads();
  for (int k = 2; k <= n2; k <<= 1) {  // bitonic sort, ascending: tiles descending, then list order
    for (int h = k >> 1; h > 0; h >>= 1) {
      for (int i = t; i < n2; i += SCHED_THREADS) {
        const int x = i ^ h;
        if (x > i) {
          const unsigned long long a = keys[i], c = keys[x];
          if ((a > c) == ((i & k) == 0)) {
            keys[i] = c;
            keys[x] = a;
          }
        }
      }
      __syncthreads();
    }
  }
  __threadfence_block();
  int* work_out = table + SCHED_HEADER;
  for (int i = t; i < n_pieces; i += SCHED_THREADS) {
    const int* sc = scratch + (long long)(unsigned)(keys[i] & 0xFFFFFFFFu) * SCHED_SCRATCH;
    const int j = sc[0], b = j / RT, Pb = P[b];
    int* w = work_out + (long long)i * kdtr::WORK_INTS;
    w[0] = b;
    w[1] = j - b * RT;
    w[2] = min(Pb, sc[1] * bn);
    w[3] = sc[3] ? Pb : min(Pb, sc[2] * bn);
    w[4] = sc[3];
    w[5] = sc[4];
  }
  if (t == 0) {
    table[0] = n_pieces;
    table[1] = n_jobs;
  }
}
