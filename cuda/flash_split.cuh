// flash_split.cuh -- the split-KV plan shared by the flash kernels (flash.cu, flash_sm90.cu):
// which keys each split walks, the planted bugs that live in that plan, and the merge of the
// splits' partial results.
//
// Workspace layout written by the main kernels when num_splits > 1 (kdtr/kernels/flash/plan.py sizes it):
//   fp32 partial out [B, splits, R, 512], then fp32 partial lse [B, splits, R] (natural log,
//   -inf for a split that saw no key of the row), then uint32 merge counters [B, row tiles, 2]
//   (in-kernel merge only; zero before a launch, zero again after it); R = T * H rows per request.
//   `splits` is p.num_splits, the grid's: the most any request takes. Request b takes S_b <= splits
//   (kdtr::request_splits, flash_sched.cuh: decided on the device from its prefix length, so that a
//   graph captured at other lengths stays right); its splits past S_b exit at once, and a request of
//   one split writes out and lse directly (the merges skip it).
// Work table (flash-sm90, kdtr/kernels/flash/schedule.py): each CTA walks the piece its table row names;
// pieces of a cut job write fp32 partial out [slots, ROWS, 512] then lse [slots, ROWS] at their slot
// (num_splits = slots), merged by kdtr_flash_combine_jobs<OutT, ROWS>; a job in one piece writes out
// directly. A partial row index prow addresses both arrays: lse at prow, out at prow * 512.
// The merge runs as kdtr_flash_combine_rows<OutT, PARTS> (one warp per row or half row: many-row grids,
// splits <= COMBINE_ROWS_MAX_SPLITS), as kdtr_flash_combine<OutT>, launched with grid (R, B, chunks <=
// COMBINE_MAX_CHUNKS) and block 32 * COMBINE_WARPS (decode batches: up to hundreds of splits), as
// kdtr_flash_combine_narrow<OutT, COLS, WARPS> (32- or 64-column chunks: rows too few for 128-column chunks
// to fill the GPU; 4 or 8 warps a CTA), or inside a main kernel that calls kdtr::merge_in_kernel (flash-sm90
// on one-wave grids); kdtr/kernels/flash/plan.py decides. The merge kernels open with kdtr::pdl_wait(): on sm_90+
// they are launched dependent on the main kernel (kdtr/kernels/pdl.py), which releases them at entry, so their
// launch overlaps its tail.
//
// The including kernel source defines kdtr::COMBINE_BATCH before it includes this header: the partial rows
// kdtr_flash_combine keeps in flight per warp (flash.cu 8, flash_sm90.cu 9; see there why).

#pragma once

#include <cuda_bf16.h>

#include "kdtr_abi.h"
#include "kdtr_common.cuh"
#include "flash_sched.cuh"

namespace kdtr {

// The keys split `split` of `nsplit` walks for a request with prefix P and T tree nodes: the
// prefix range [lo, hi), n_pre tiles of BN keys over it, and the tree tail when it is the last
// split. Every split gets L = ceil((prefix tiles + tail tiles) / nsplit) tiles, the tail counted
// as ceil(T / BN) tiles, so the last split walks fewer prefix tiles and does not finish a tail
// behind the others (a one-wave grid waits for its slowest CTA). The
// planted DROP_* bugs shorten the range here.
struct SplitKeys {
  int lo, hi, n_pre;
  bool has_tail;
};

// Prefix keys [lo, hi) (+ the tail) of a request with prefix P, as a kernel with planted bug BUG walks them.
template <int BN, int BUG>
__device__ __forceinline__ SplitKeys range_keys(int P, int lo, int hi, bool has_tail) {
  SplitKeys k;
  k.lo = lo;
  k.hi = hi;
  if (BUG == KDTR_BUG_DROP_PARTIAL_TILE) k.hi = max(k.lo, min(k.hi, P / KDTR_BUG_TILE * KDTR_BUG_TILE));
  if (BUG == KDTR_BUG_DROP_PREFIX_KEY && P > 0 && k.hi == P) k.hi = max(k.lo, P - 1);
  k.n_pre = (k.hi - k.lo + BN - 1) / BN;
  k.has_tail = has_tail;
  return k;
}

template <int BN, int BUG>
__device__ __forceinline__ SplitKeys split_keys(int P, int T, int split, int nsplit) {
  const int tiles = (P + BN - 1) / BN + (T + BN - 1) / BN;
  const int split_len = max(1, (tiles + nsplit - 1) / nsplit) * BN;
  const int lo = min(P, split * split_len);
  return range_keys<BN, BUG>(P, lo, split == nsplit - 1 ? P : min(P, lo + split_len), split == nsplit - 1);
}

// A work-table CTA's work (flash-sm90, MERGE_WORK_TABLE): request b, row tile rt, its keys and where its rows
// go (direct: out and lse; else partial row prow0 + r of row r, the lse partials lse_off floats into
// the workspace), from row blockIdx.x of the work table, ROWS rows a slot. Partial rows count below
// 2^31 (their workspace would be 4 TB).
struct CtaWork {
  int b, rt, P;
  SplitKeys keys;
  bool direct;
  int prow0;
  long long lse_off;
};

template <int BN, int BUG, int ROWS>
__device__ __forceinline__ CtaWork work_table_row(const KdtrParams& p, const FlashSched& s) {
  CtaWork c;
  const int* w = sched_work(p, s) + (long long)blockIdx.x * WORK_INTS;
  c.b = w[0];
  c.rt = w[1];
  c.P = p.prefix_lens[c.b];
  c.keys = range_keys<BN, BUG>(c.P, w[2], w[3], w[4] != 0);
  c.direct = w[5] < 0;
  c.prow0 = (w[5] - c.rt) * ROWS;
  c.lse_off = (long long)p.num_splits * ROWS * KDTR_DV;
  return c;
}

// Mask word w of node t as a kernel with planted bug BUG reads it (SIBLING_VISIBLE adds node t-1; the
// mask-word bugs of kdtr/kernels/bugs.py change what the word says).
template <int BUG>
__device__ __forceinline__ unsigned planted_mask_word(unsigned word, int t, int w) {
  if (BUG == KDTR_BUG_SIBLING_VISIBLE && t >= 1 && (t - 1) / 32 == w) word |= 1u << ((t - 1) % 32);
  if (BUG == KDTR_BUG_MASK_BIT_ORDER) word = __brev(word);
  if (BUG == KDTR_BUG_CAUSAL_MASK) word = t >= w * 32 + 31 ? ~0u : t >= w * 32 ? (2u << (t - w * 32)) - 1u : 0u;  // nodes 0..t
  if (BUG == KDTR_BUG_NO_SELF && t / 32 == w) word &= ~(1u << (t % 32));
  return word;
}

// The planted bugs that read a mask word from another address (tree_mask_word below).
template <int BUG>
constexpr bool MASK_ADDRESS_BUG = BUG == KDTR_BUG_MASK_STRIDE || BUG == KDTR_BUG_MASK_REQUEST0;

// Mask word w of node t of request b where a MASK_ADDRESS_BUG reads it, then planted_mask_word.
template <int BUG>
__device__ __forceinline__ unsigned tree_mask_word(const KdtrParams& p, int b, int t, int w) {
  long long at = ((long long)(BUG == KDTR_BUG_MASK_REQUEST0 ? 0 : b) * p.T + t) * p.mask_words + w;
  if (BUG == KDTR_BUG_MASK_STRIDE)  // the row stride of a T + 1-node mask; the mask's last word past its end
    at = min(((long long)b * p.T + t) * (p.T / KDTR_MASK_BITS + 1) + w, (long long)p.B * p.T * p.mask_words - 1);
  return planted_mask_word<BUG>(p.tree_mask[at], t, w);
}

// Calls mark(word, w) for every mask word w of every tree node that rows [r0, r_end) of request b
// belong to (row r is node r / H; r_end <= R), as a kernel with planted bug BUG reads them; the
// NTHREADS threads of the CTA share the words. Kernels mark the tail tiles a word makes live.
template <int NTHREADS, int BUG, typename Mark>
__device__ __forceinline__ void for_each_tail_word(const KdtrParams& p, int b, const unsigned* mask_b, int r0, int r_end,
                                                   int H, int W, int tid, Mark mark) {
  const int t_lo = r0 / H, t_hi = (r_end - 1) / H;
  for (int idx = tid; idx < (t_hi - t_lo + 1) * W; idx += NTHREADS) {
    const int t = t_lo + idx / W, w = idx % W;
    if constexpr (MASK_ADDRESS_BUG<BUG>) mark(tree_mask_word<BUG>(p, b, t, w), w);
    else mark(planted_mask_word<BUG>(mask_b[(long long)t * W + w], t, w), w);
  }
}

// Row of the request's q that query row r reads (Q_HEAD_MAJOR: q taken as [H, T, 576]).
template <int BUG>
__device__ __forceinline__ int planted_q_row(int r, int T, int H) {
  return BUG == KDTR_BUG_Q_HEAD_MAJOR ? r % H * T + r / H : r;
}

// First block-table entry of request b with prefix P (BLOCK_TABLE_STRIDE: rows packed at each request's own
// page count).
template <int BUG>
__device__ __forceinline__ long long block_table_row(const KdtrParams& p, int b, int P) {
  return (long long)b * (BUG == KDTR_BUG_BLOCK_TABLE_STRIDE ? (P + p.T + p.page_size - 1) / p.page_size : p.max_pages);
}

// Token whose cache row holds key j of a request with prefix P (TAIL_POSITION: tree node j - P at token j - P).
template <int BUG>
__device__ __forceinline__ int planted_token(int j, int P) {
  return BUG == KDTR_BUG_TAIL_POSITION && j >= P ? j - P : j;
}

// A value the kernel stores in out or in a partial row (OUT_TRUNCATE with bf16 out: rounded toward zero to bf16).
template <int BUG, typename OutT>
__device__ __forceinline__ float planted_store(float x) {
  if constexpr (BUG == KDTR_BUG_OUT_TRUNCATE && sizeof(OutT) == 2) return __uint_as_float(__float_as_uint(x) & 0xffff0000u);
  return x;
}

// The kernels' softmax factors as planted bugs change them: the exp2 domain's log2(e) (MISSING_LOG2E drops it),
// the natural log of the lse written from log2 (LSE_LOG2 writes log2), the first column of V (V_COLUMNS: 64).
template <int BUG>
constexpr float PLANTED_LOG2E = BUG == KDTR_BUG_MISSING_LOG2E ? 1.0f : LOG2E;
template <int BUG>
constexpr float PLANTED_LN2 = BUG == KDTR_BUG_LSE_LOG2 ? 1.0f : LN2;
template <int BUG>
constexpr int V_COL0 = BUG == KDTR_BUG_V_COLUMNS ? KDTR_DROPE : 0;

}  // namespace kdtr

constexpr int COMBINE_WARPS = 8;        // warps of the combine kernel (and of flash-sm90's in-kernel merge)
constexpr int COMBINE_MAX_CHUNKS = 4;   // CTAs per row at most: column chunks (grid.z = 1, 2 or 4; kdtr/kernels/flash/plan.py picks)
constexpr int COMBINE_ROWS_MAX_SPLITS = 32;  // kdtr_flash_combine_rows: lane s holds split s's lse
constexpr int COMBINE_ROWS_BATCH = 4;   // kdtr::merge_row_warp: partial rows in flight a warp over all 512 columns
constexpr int ROW_F4_PER_LANE = KDTR_DV / 4 / 32;  // kdtr::merge_row_warp: float4 of a whole row per lane (4)
constexpr int COMBINE_RED_FLOATS = COMBINE_WARPS * 129 + COMBINE_WARPS;  // shared scratch of merge_row
// kdtr::merge_chunk_narrow (kdtr_flash_combine_narrow's body): COLS columns a unit and WARPS warps a CTA
// (template arguments that kdtr/kernels/flash/plan.py picks: 32 or 64, 4 or 8), a float4 per lane; NARROW_BATCH loads
// a lane in flight make 288 splits one step at 32 columns and 8 warps (>= the 264 of two all-transposed CTAs on each
// of 132 SMs), 144 at 64 columns, half that at 4 warps (kdtr/kernels/flash/plan.py reads it from the config array).
constexpr int NARROW_BATCH = 9;
constexpr float NARROW_FLOOR = -3.0e38f;  // below any lse; (floor - lse) * LOG2E overflows to -inf
// shared scratch of merge_chunk_narrow<COLS, WARPS>: [warps][COLS / 4 lanes][max, weight sum, 4 sums]
__host__ __device__ constexpr int narrow_red_floats(int cols, int warps) { return warps * (cols / 4) * 6; }
// Partial rows in flight per warp in kdtr::merge_row. In-kernel merges run on one-wave grids: 8 warps
// x 17 = 136 >= the splits of a 132-SM grid, all in one step. The combine kernel keeps 8-9: at 17 its
// 256 threads needed more than 168 registers on sm_120 (spills).
constexpr int MERGE_BATCH_IN_KERNEL = 17, MERGE_BATCH_COMBINE = kdtr::COMBINE_BATCH;

namespace kdtr {

// Values 4 i .. 4 i + 3 of an fp32 partial row starting at src (16-byte aligned), as a float4.
__device__ __forceinline__ float4 load_part4(const float* src, int i) { return reinterpret_cast<const float4*>(src)[i]; }
// ... and stored there from a float4.
__device__ __forceinline__ void store_part4(float* dst, int i, float4 v) { reinterpret_cast<float4*>(dst)[i] = v; }

// Output row `row` of request b as the workspace holds it split by split (layout above): what merge_row
// and merge_chunk_narrow read.
struct RowPartials {
  const float* ws_o;  // partial out [B, S, R, 512] (the workspace's start)
  const float* lse_r;  // this row's partial lse, split s at lse_r[s * R]
  long long b;
  int R, S, row;  // S: the workspace's splits (p.num_splits), its stride
  __device__ __forceinline__ RowPartials(const KdtrParams& p, int b_, int row_)
      : ws_o(static_cast<const float*>(p.workspace)), b(b_), R(p.T * p.H), S(p.num_splits), row(row_) {
    lse_r = static_cast<const float*>(p.workspace) + (long long)p.B * S * R * KDTR_DV + b * S * R + row;
  }
  __device__ __forceinline__ float lse(int s) const { return lse_r[(long long)s * R]; }
  __device__ __forceinline__ float4 chunk(int s, int c4) const {  // split s's values 4 c4 .. 4 c4 + 3 of the row
    return load_part4(ws_o + ((b * S + s) * R + row) * KDTR_DV, c4);
  }
};

// Merges output row `row` of request b, columns [col0, col0 + cols) (cols: 128, 256 or 512), from
// its S splits' partials: out = sum_s w_s o_s / sum_s w_s with w_s = exp(lse_s - max lse). The
// NWARPS calling warps (warp, lane) are spread over the 128-column groups and, within a group, over
// the splits, BATCH partial rows in flight per warp; their sums meet in `red` (COMBINE_RED_FLOATS of
// shared memory); `sync` is a barrier of those warps. In-kernel, other CTAs of the grid wrote the
// partials: merge_in_kernel's acquire and barrier make them visible first. col0 == 0 writes lse.
template <typename OutT, int NWARPS, int BATCH, typename Sync>
__device__ __forceinline__ void merge_row(const KdtrParams& p, int row, int b, int S, int col0, int cols, int warp,
                                          int lane, float* red, Sync sync) {
  const int R = p.T * p.H;
  const int groups = cols / 128, group = warp % groups, warps_per_group = NWARPS / groups;
  float* mx = red + NWARPS * 129;  // red: [NWARPS][128 + 1] (+1: the warp's weight sum), then the warp maxima
  const RowPartials part(p, b, row);

  const int c4 = (col0 + group * 128) / 4 + lane;  // this lane's float4 of a partial row
  // BATCH splits per warp and step, all their lse and row loads issued before any is used. An index
  // past S reads split S - 1 again with weight 0; every partial row is written (zeros for a split
  // that saw no key of the row), and a zero weight adds nothing. Where one step covers every split
  // it also gives the lse maximum, without a trip of its own.
  const int step = BATCH * warps_per_group;
  float ls[BATCH];
  float4 x[BATCH];
  auto load = [&](int s0) {
#pragma unroll
    for (int k = 0; k < BATCH; ++k) {
      const int sk = min(s0 + k * warps_per_group, S - 1);
      ls[k] = part.lse(sk);
      x[k] = part.chunk(sk, c4);
    }
  };
  const int first = warp / groups;
  load(first);
  float M = neg_inf();
  if (S <= step) {  // every split is in some warp's first step (past S: split S - 1 again)
#pragma unroll
    for (int k = 0; k < BATCH; ++k) M = fmaxf(M, ls[k]);
  } else {
    for (int s = warp * 32 + lane; s < S; s += 32 * NWARPS) M = fmaxf(M, part.lse(s));
  }
  M = warp_max<32>(M);
  if (lane == 0) mx[warp] = M;
  sync();
  M = mx[0];
#pragma unroll
  for (int w = 1; w < NWARPS; ++w) M = fmaxf(M, mx[w]);

  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  float wsum = 0.f;
  for (int s0 = first;;) {
#pragma unroll
    for (int k = 0; k < BATCH; ++k) {
      const bool live = s0 + k * warps_per_group < S && ls[k] != neg_inf();
      const float w = exp2f(live ? (ls[k] - M) * LOG2E : neg_inf());  // no branch: 2^-inf = 0
      wsum += w;
      acc.x += w * x[k].x;  // x is finite (see above), so a weight of 0 adds nothing; a `live ?` here
      acc.y += w * x[k].y;  // made the compiler sink each load to its use: one L2 trip per split in
      acc.z += w * x[k].z;  // turn, ~5 us for 129 splits (SASS)
      acc.w += w * x[k].w;
    }
    s0 += step;
    if (s0 >= S) break;
    load(s0);
  }
  float* mine = red + warp * 129;
  mine[4 * lane + 0] = acc.x;
  mine[4 * lane + 1] = acc.y;
  mine[4 * lane + 2] = acc.z;
  mine[4 * lane + 3] = acc.w;
  if (lane == 0) mine[128] = wsum;
  sync();
  float total = 0.f;  // every group saw every split once: the weights of group 0's warps
  for (int w = 0; w < NWARPS; w += groups) total += red[w * 129 + 128];
  const float inv = 1.f / total;
  OutT* out = static_cast<OutT*>(p.out) + ((long long)b * R + row) * KDTR_DV + col0;
  for (int c = 2 * (warp * 32 + lane); c < cols; c += 2 * 32 * NWARPS) {
    const int gc = c / 128, cc = c % 128;
    float x = 0.f, y = 0.f;
    for (int w = gc; w < NWARPS; w += groups) {
      x += red[w * 129 + cc];
      y += red[w * 129 + cc + 1];
    }
    store2<OutT>(out + c, x * inv, y * inv);
  }
  if (col0 == 0 && warp == 0 && lane == 0) p.lse[(long long)b * R + row] = M + logf(total);
  sync();  // red is reused by the next row
}

// Merges output row `row` of request b, columns [chunk * COLS, chunk * COLS + COLS), from the splits' partials
// (as merge_row). At COLS = 32, 8 lanes share a partial row's 128 bytes, so a warp reads 4 splits per load and
// 8 calling warps 32; NARROW_BATCH loads a lane in flight make 288 splits one step: <= 288 splits are one L2
// round trip for 9 KB of lse and 36 KB of rows (at 64: 16 lanes, 144 splits a step; 4 warps: half). Each
// thread keeps a running maximum over its splits s = slot + STRIDE k (in order); the threads of a column in a
// warp, then the warps, combine theirs in a fixed order, so the result does not depend on timing. `red`:
// narrow_red_floats(COLS, WARPS) of shared memory; `sync`: a barrier of the WARPS calling warps; chunk 0
// writes lse.
template <typename OutT, int COLS, int WARPS, typename Sync>
__device__ __forceinline__ void merge_chunk_narrow(const KdtrParams& p, int row, int b, int S, int chunk, int warp,
                                                   int lane, float* red, Sync sync) {
  static_assert(COLS == 16 || COLS == 32 || COLS == 64, "a float4 per lane, 2-8 splits a warp");
  static_assert(WARPS >= 1 && WARPS <= 32, "warps of a CTA");
  constexpr int NARROW_LANES = COLS / 4, STRIDE = WARPS * 32 / NARROW_LANES;  // lanes a partial row, splits a load
  const int R = p.T * p.H, q = lane % NARROW_LANES;
  const int slot = warp * (32 / NARROW_LANES) + lane / NARROW_LANES;  // this thread's first split
  const RowPartials part(p, b, row);
  const int c4 = chunk * NARROW_LANES + q;  // this lane's float4 of a partial row
  float m = NARROW_FLOOR, wsum = 0.f;  // a finite floor, not -inf: 2^(-inf - m) is then 0, never NaN
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int s0 = slot; s0 < S; s0 += STRIDE * NARROW_BATCH) {
    float ls[NARROW_BATCH];
    float4 x[NARROW_BATCH];
#pragma unroll
    for (int k = 0; k < NARROW_BATCH; ++k) {  // past S: split S - 1 again, weight 0 (as merge_row)
      const int sk = min(s0 + k * STRIDE, S - 1);
      ls[k] = part.lse(sk);
      x[k] = part.chunk(sk, c4);
    }
    float mk = m;
#pragma unroll
    for (int k = 0; k < NARROW_BATCH; ++k) {
      ls[k] = s0 + k * STRIDE < S ? ls[k] : neg_inf();
      mk = fmaxf(mk, ls[k]);
    }
    const float scale = exp2f((m - mk) * LOG2E);
    wsum *= scale;
    acc = make_float4(acc.x * scale, acc.y * scale, acc.z * scale, acc.w * scale);
#pragma unroll
    for (int k = 0; k < NARROW_BATCH; ++k) {
      const float w = exp2f((ls[k] - mk) * LOG2E);
      wsum += w;
      acc.x += w * x[k].x;
      acc.y += w * x[k].y;
      acc.z += w * x[k].z;
      acc.w += w * x[k].w;
    }
    m = mk;
  }
  auto merge = [&](float m2, float w2, float4 a2) {  // (m, wsum, acc) += (m2, w2, a2), in this lane's fixed order
    const float M = fmaxf(m, m2), s1 = exp2f((m - M) * LOG2E), s2 = exp2f((m2 - M) * LOG2E);
    wsum = wsum * s1 + w2 * s2;
    acc = make_float4(acc.x * s1 + a2.x * s2, acc.y * s1 + a2.y * s2, acc.z * s1 + a2.z * s2, acc.w * s1 + a2.w * s2);
    m = M;
  };
#pragma unroll
  for (int off = NARROW_LANES; off < 32; off *= 2) {  // the warp's threads of column q
    const float m2 = __shfl_xor_sync(0xffffffffu, m, off), w2 = __shfl_xor_sync(0xffffffffu, wsum, off);
    const float4 a2 = make_float4(__shfl_xor_sync(0xffffffffu, acc.x, off), __shfl_xor_sync(0xffffffffu, acc.y, off),
                                  __shfl_xor_sync(0xffffffffu, acc.z, off), __shfl_xor_sync(0xffffffffu, acc.w, off));
    merge(m2, w2, a2);
  }
  float* mine = red + (warp * NARROW_LANES + q) * 6;  // red: [warps][NARROW_LANES][max, weight sum, 4 sums]
  if (lane < NARROW_LANES) {
    mine[0] = m, mine[1] = wsum, mine[2] = acc.x, mine[3] = acc.y, mine[4] = acc.z, mine[5] = acc.w;
  }
  sync();
  if (warp == 0 && lane < NARROW_LANES) {
    for (int w = 1; w < WARPS; ++w) {  // warps in order
      const float* r = red + (w * NARROW_LANES + q) * 6;
      merge(r[0], r[1], make_float4(r[2], r[3], r[4], r[5]));
    }
    const float inv = 1.f / wsum;
    OutT* out = static_cast<OutT*>(p.out) + ((long long)b * R + row) * KDTR_DV + 4 * c4;
    store2<OutT>(out, acc.x * inv, acc.y * inv);
    store2<OutT>(out + 2, acc.z * inv, acc.w * inv);
    if (chunk == 0 && lane == 0) p.lse[(long long)b * R + row] = m + logf(wsum);
  }
  sync();  // red is reused by the next chunk
}

// The merge inside a main kernel, for a grid whose CTAs are all resident at once (one wave;
// kdtr/kernels/flash/plan.py checks). Called by NWARPS warps (thread t: 0 .. 32 * NWARPS - 1) of every CTA of
// (request b, row tile rt = blockIdx.x) once this CTA's partials are written. Each CTA fences them and takes a
// ticket; the last `mergers` to arrive merge, the others leave. The merge units are (row,
// 128-column group) of rows [r0, r0 + nrows), unit u going to merger u % mergers. A merger waits
// until every split has arrived: by then all but mergers - 1 CTAs of the row tile have finished
// and freed their SMs, so waiting CTAs never hold the GPU for the whole kernel (first arrivals
// waiting would). The last merger to finish zeroes the two counters for the next launch.
template <typename OutT, int NWARPS, typename Sync>
__device__ __forceinline__ void merge_in_kernel(const KdtrParams& p, int b, int S, int rt, int r0, int nrows, int t,
                                                float* red, int* ticket_s, Sync sync) {
  constexpr int GROUPS = KDTR_DV / 128;  // 128-column units per row
  const int R = p.T * p.H, units = nrows * GROUPS, mergers = min(S, units);
  const int row_tiles = gridDim.x;  // the caller's row tiles
  unsigned* ctr = reinterpret_cast<unsigned*>(static_cast<float*>(p.workspace) +
                                              (long long)p.B * p.num_splits * R * (KDTR_DV + 1)) +
                  2 * ((long long)b * row_tiles + rt);  // [arrived, merged]
  __threadfence();  // this thread's partials before the ticket (the caller's barrier orders the rest)
  sync();
  if (t == 0) *ticket_s = atomicAdd(ctr, 1u);
  sync();
  const int rank = *ticket_s - (S - mergers);
  if (rank < 0) return;  // an early arrival: the last `mergers` CTAs merge
  if (t == 0) {
    unsigned n;
    while (true) {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(n) : "l"(ctr) : "memory");
      if (n >= (unsigned)S) break;
      __nanosleep(32);
    }
  }
  sync();  // every split's partials are visible from here (their fence, then the acquire above)
  for (int u = rank; u < units; u += mergers)
    merge_row<OutT, NWARPS, MERGE_BATCH_IN_KERNEL>(p, r0 + u / GROUPS, b, S, (u % GROUPS) * 128, 128, t >> 5, t & 31, red,
                                                   sync);
  if (t == 0 && atomicAdd(ctr + 1, 1u) == (unsigned)mergers - 1) {
    ctr[0] = 0u;  // every merger is past its wait: the counters start the next launch at zero
    ctr[1] = 0u;
  }
}


// One warp merges columns [col0, col0 + 128 PER_LANE) of one output row from S partial rows: partial s's
// lse at ws_lse[prow(s)], its row at ws_o + prow(s) * 512; `out` is the output row. Lane s holds slot s's
// lse (32 at a time), every lane reads its 4 PER_LANE columns (PER_LANE float4, lane + 32 j) of BATCH
// partials at a time; no barrier, no shared memory. The whole row (PER_LANE 4) keeps COMBINE_ROWS_BATCH
// partials in flight; half a row (PER_LANE 2), twice as many in the same registers. lse_out: written if not
// null. ANY_S: S may pass 32 (the chunk loop costs ~20 registers, so callers with S <= 32 leave it out).
template <typename OutT, bool ANY_S, int PER_LANE, int BATCH, typename Prow>
__device__ __forceinline__ void merge_row_warp(const float* ws_o, const float* ws_lse, Prow prow, int S, OutT* out,
                                               float* lse_out, int lane, int col0) {
  static_assert(PER_LANE * BATCH == ROW_F4_PER_LANE * COMBINE_ROWS_BATCH, "the loads in flight a lane: 16 float4");
  const float l0 = lane < S ? ws_lse[prow(lane)] : neg_inf();
  float M = l0;
  if (ANY_S)
    for (int s = lane + 32; s < S; s += 32) M = fmaxf(M, ws_lse[prow(s)]);
  M = warp_max<32>(M);
  float4 acc[PER_LANE];
#pragma unroll
  for (int j = 0; j < PER_LANE; ++j) acc[j] = make_float4(0.f, 0.f, 0.f, 0.f);
  float wsum = 0.f;
  for (int c0 = 0; c0 < (ANY_S ? S : 1); c0 += 32) {
    const float lse = c0 == 0 ? l0 : c0 + lane < S ? ws_lse[prow(c0 + lane)] : neg_inf();
    const int n = ANY_S ? min(32, S - c0) : S;
    for (int s0 = 0; s0 < n; s0 += BATCH) {
      float4 x[BATCH][PER_LANE];
#pragma unroll
      for (int k = 0; k < BATCH; ++k) {  // an index past S reads partial S - 1 again, with weight 0
        const float* src = ws_o + prow(min(c0 + s0 + k, S - 1)) * KDTR_DV + col0;
#pragma unroll
        for (int j = 0; j < PER_LANE; ++j) x[k][j] = load_part4(src, lane + 32 * j);
      }
#pragma unroll
      for (int k = 0; k < BATCH; ++k) {
        const float ls = __shfl_sync(0xffffffffu, lse, (s0 + k) & 31);
        const float w = s0 + k < n && ls != neg_inf() ? exp2f((ls - M) * LOG2E) : 0.f;
        wsum += w;
#pragma unroll
        for (int j = 0; j < PER_LANE; ++j) {
          acc[j].x += w * x[k][j].x;
          acc[j].y += w * x[k][j].y;
          acc[j].z += w * x[k][j].z;
          acc[j].w += w * x[k][j].w;
        }
      }
    }
  }
  const float inv = 1.f / wsum;
#pragma unroll
  for (int j = 0; j < PER_LANE; ++j) {
    const int c = col0 + 4 * (lane + 32 * j);
    store2<OutT>(out + c, acc[j].x * inv, acc[j].y * inv);
    store2<OutT>(out + c + 2, acc[j].z * inv, acc[j].w * inv);
  }
  if (lane == 0 && lse_out) *lse_out = M + logf(wsum);
}

}  // namespace kdtr

// One warp per output row (PARTS = 1) or half row (PARTS = 2, grid.z the half), COMBINE_WARPS rows per CTA,
// grid (ceil(R / COMBINE_WARPS), B, PARTS), for splits <= COMBINE_ROWS_MAX_SPLITS (kdtr::merge_row_warp).
// kdtr/kernels/flash/plan.py picks it where the rows alone fill the GPU (compute shapes), where kdtr_flash_combine's
// one row per CTA waited on three dependent round trips per row (0.75 TB/s measured); halves
// where the splits pass COMBINE_ROWS_BATCH, so that they take half the round trips with twice the warps.
template <typename OutT, int PARTS>
__global__ void __launch_bounds__(32 * COMBINE_WARPS) kdtr_flash_combine_rows(const KdtrParams p, const FlashSched sched) {
  static_assert(PARTS == 1 || PARTS == 2, "whole or half rows");
  const int R = p.T * p.H, stride = p.num_splits, b = blockIdx.y;
  const int S = kdtr::request_splits(sched, p.prefix_lens[b]);  // this request's splits (one: written directly)
  kdtr::pdl_wait();  // launched as dependent of the main kernel (kdtr/kernels/flash/kernel.py)
  const int row = blockIdx.x * COMBINE_WARPS + (threadIdx.x >> 5);
  if (row >= R || S <= 1) return;
  const float* ws = static_cast<const float*>(p.workspace);
  kdtr::merge_row_warp<OutT, false, ROW_F4_PER_LANE / PARTS, COMBINE_ROWS_BATCH * PARTS>(
      ws, ws + (long long)p.B * stride * R * KDTR_DV, [&](int s) { return ((long long)b * stride + s) * R + row; }, S,
      static_cast<OutT*>(p.out) + ((long long)b * R + row) * KDTR_DV,
      PARTS == 1 || blockIdx.z == 0 ? p.lse + (long long)b * R + row : nullptr, threadIdx.x & 31,
      PARTS == 1 ? 0 : blockIdx.z * (KDTR_DV / PARTS));
}

// The work table's cut jobs' merge, one warp per row, grid (ROWS / COMBINE_WARPS, the table's job rows);
// job row blockIdx.y of the scheduler's job table (JOB_INTS each) names the request, its first row and its slots,
// ROWS rows a slot (kdtr/kernels/flash/schedule.py; any number of slots); CTAs past this launch's cut jobs exit.
template <typename OutT, int ROWS>
__global__ void __launch_bounds__(32 * COMBINE_WARPS) kdtr_flash_combine_jobs(const KdtrParams p, const FlashSched sched) {
  kdtr::pdl_wait();  // launched as dependent of the main kernel (kdtr/kernels/flash/kernel.py)
  if ((int)blockIdx.y >= kdtr::sched_table(p, sched)[1]) return;
  const int* job = kdtr::sched_jobs(p, sched) + (long long)blockIdx.y * kdtr::JOB_INTS;
  const int b = job[0], r0 = job[1], slot0 = job[2], S = job[3], rl = blockIdx.x * COMBINE_WARPS + (threadIdx.x >> 5);
  const int R = p.T * p.H, row = r0 + rl;
  if (rl >= ROWS || row >= R) return;
  const float* ws = static_cast<const float*>(p.workspace);
  kdtr::merge_row_warp<OutT, true, ROW_F4_PER_LANE, COMBINE_ROWS_BATCH>(
      ws, ws + (long long)p.num_splits * ROWS * KDTR_DV, [&](int s) { return (long long)(slot0 + s) * ROWS + rl; }, S,
      static_cast<OutT*>(p.out) + ((long long)b * R + row) * KDTR_DV, p.lse + (long long)b * R + row, threadIdx.x & 31, 0);
}

// One CTA of WARPS warps per (row, request, COLS-column chunk), grid (R, B, 512 / COLS): kdtr::merge_chunk_narrow,
// for decode grids of few rows, where kdtr_flash_combine's CTAs, one per row and 128 columns, read their
// splits in steps of 72 partial rows, an L2 round trip each, with the lse maximum a trip of its own (~6 us
// after the all-transposed build's 241 splits); 32 columns for 8 rows, 64 on more; 4 warps where they take every split in one
// step, so that twice the CTAs are resident and a grid of up to ~80 rows is one wave (docs/PERF.md ledger, combine-narrow, narrow-warps).
template <typename OutT, int COLS, int WARPS>
__global__ void __maxnreg__(128) kdtr_flash_combine_narrow(const KdtrParams p, const FlashSched sched) {  // 32 * WARPS threads
  __shared__ float red[narrow_red_floats(COLS, WARPS)];
  const int S = kdtr::request_splits(sched, p.prefix_lens[blockIdx.y]);
  kdtr::pdl_wait();  // launched as dependent of the main kernel (kdtr/kernels/flash/kernel.py)
  if (S <= 1) return;  // one split: the main kernel wrote this request's rows
  kdtr::merge_chunk_narrow<OutT, COLS, WARPS>(p, blockIdx.x, blockIdx.y, S, blockIdx.z, threadIdx.x >> 5, threadIdx.x & 31,
                                              red, [] { __syncthreads(); });
}

// One CTA per (row, request, column chunk): kdtr::merge_row over the chunk's columns. Decode
// batches (few rows) use 4 chunks so the merge streams on more SMs; large batches one, which keeps
// the CTA count (and its fixed cost) down (kdtr/kernels/flash/plan.py picks). Chunk 0 writes lse.
// __maxnreg__, not __launch_bounds__(256): under those bounds ptxas gave it 32 registers and issued
// each split's loads after the previous split's use (tests/kernels/test_compile.py).
template <typename OutT>
__global__ void __maxnreg__(128) kdtr_flash_combine(const KdtrParams p, const FlashSched sched) {  // 256 threads (COMBINE_WARPS)
  __shared__ float red[COMBINE_RED_FLOATS];
  const int S = kdtr::request_splits(sched, p.prefix_lens[blockIdx.y]);
  kdtr::pdl_wait();  // launched as dependent of the main kernel (kdtr/kernels/flash/kernel.py)
  if (S <= 1) return;  // one split: the main kernel wrote this request's rows
  const int cols = KDTR_DV / gridDim.z;
  kdtr::merge_row<OutT, COMBINE_WARPS, MERGE_BATCH_COMBINE>(p, blockIdx.x, blockIdx.y, S, blockIdx.z * cols, cols,
                                                            threadIdx.x >> 5, threadIdx.x & 31, red, [] { __syncthreads(); });
}
