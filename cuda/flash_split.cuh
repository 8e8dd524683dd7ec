// flash_split.cuh -- the split-KV plan shared by the flash kernels (flash_verify.cu, flash_sm90.cu):
// which keys each split walks, the planted bugs that live in that plan, and the merge of the
// splits' partial results.
//
// Workspace layout written by the main kernels when num_splits > 1 (kdtr/flash.py sizes it):
//   fp32 partial out [B, splits, R, 512], then fp32 partial lse [B, splits, R] (natural log,
//   -inf for a split that saw no key of the row); R = T * H rows per request.
// kdtr_flash_combine<OutT> is launched with grid (R, B, chunks <= COMBINE_MAX_CHUNKS), block 32 * COMBINE_WARPS.

#pragma once

#include <cuda_bf16.h>

#include "kdtr_abi.h"
#include "kdtr_common.cuh"

namespace kdtr {

// The keys split `split` of `nsplit` walks for a request with prefix P: the prefix range [lo, hi)
// (equal BN-aligned ranges), n_pre tiles of BN keys over it, and the tree tail when it is the last
// split. The planted DROP_* bugs shorten the range here.
struct SplitKeys {
  int lo, hi, n_pre;
  bool has_tail;
};

template <int BN, int BUG>
__device__ __forceinline__ SplitKeys split_keys(int P, int split, int nsplit) {
  const int split_len = max(BN, ((P + nsplit - 1) / nsplit + BN - 1) / BN * BN);
  SplitKeys k;
  k.lo = min(P, split * split_len);
  k.hi = min(P, k.lo + split_len);
  if (BUG == KDTR_BUG_DROP_PARTIAL_TILE) k.hi = max(k.lo, min(k.hi, P / KDTR_BUG_TILE * KDTR_BUG_TILE));
  if (BUG == KDTR_BUG_DROP_PREFIX_KEY && P > 0 && k.hi == P) k.hi = max(k.lo, P - 1);
  k.n_pre = (k.hi - k.lo + BN - 1) / BN;
  k.has_tail = split == nsplit - 1;
  return k;
}

// Mask word w of node t as a kernel with planted bug BUG reads it (SIBLING_VISIBLE adds node t-1).
template <int BUG>
__device__ __forceinline__ unsigned planted_mask_word(unsigned word, int t, int w) {
  if (BUG == KDTR_BUG_SIBLING_VISIBLE && t >= 1 && (t - 1) / 32 == w) word |= 1u << ((t - 1) % 32);
  return word;
}

// Calls mark(word, w) for every mask word w of every tree node that rows [r0, min(R, r0 + BM))
// of a request belong to (row r is node r / H), as a kernel with planted bug BUG reads them; the
// NTHREADS threads of the CTA share the words. Kernels mark the tail tiles a word makes live.
template <int BM, int NTHREADS, int BUG, typename Mark>
__device__ __forceinline__ void for_each_tail_word(const unsigned* mask_b, int r0, int R, int H, int W, int tid,
                                                   Mark mark) {
  const int t_lo = r0 / H, t_hi = (min(R, r0 + BM) - 1) / H;
  for (int idx = tid; idx < (t_hi - t_lo + 1) * W; idx += NTHREADS) {
    const int t = t_lo + idx / W, w = idx % W;
    mark(planted_mask_word<BUG>(mask_b[(long long)t * W + w], t, w), w);
  }
}

}  // namespace kdtr

constexpr int COMBINE_WARPS = 8;        // warps of the combine kernel
constexpr int COMBINE_MAX_CHUNKS = 4;   // CTAs per row at most: column chunks (grid.z = 1, 2 or 4; kdtr/flash.py picks)

// One CTA per (row, request, column chunk): out = sum_s w_s o_s / sum_s w_s with
// w_s = exp(lse_s - max lse). The chunk's columns come in groups of 128 (one float4 per lane);
// the 8 warps are spread over the groups and, within a group, over the splits, 4 partial rows in
// flight per warp; the warp partials are summed in shared memory. Decode batches (few rows) run 4
// chunks so the merge streams on more SMs; large batches one, which keeps the CTA count (and its
// fixed cost) down (kdtr/flash.py picks). Chunk 0 writes lse.

template <typename OutT>
__global__ void __launch_bounds__(32 * COMBINE_WARPS) kdtr_flash_combine(const KdtrParams p) {
  const int R = p.T * p.H, S = p.num_splits;
  const int cols = KDTR_DV / gridDim.z, groups = cols / 128;  // this CTA's columns, in groups of 128
  const int row = blockIdx.x, b = blockIdx.y, col0 = blockIdx.z * cols;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int group = warp % groups, warps_per_group = COMBINE_WARPS / groups;
  __shared__ float red[COMBINE_WARPS][128 + 1];  // +1: the warp's weight sum
  __shared__ float mx[COMBINE_WARPS];
  const float* ws_o = static_cast<const float*>(p.workspace);
  const float* lse_s = ws_o + (long long)p.B * S * R * KDTR_DV + (long long)b * S * R + row;  // stride R

  float M = kdtr::neg_inf();
  for (int s = threadIdx.x; s < S; s += 32 * COMBINE_WARPS) M = fmaxf(M, lse_s[(long long)s * R]);
  M = kdtr::warp_max<32>(M);
  if (lane == 0) mx[warp] = M;
  __syncthreads();
  M = mx[0];
#pragma unroll
  for (int w = 1; w < COMBINE_WARPS; ++w) M = fmaxf(M, mx[w]);

  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  float wsum = 0.f;
  const int c4 = (col0 + group * 128) / 4 + lane;  // this lane's float4 of a partial row
#pragma unroll 4
  for (int s = warp / groups; s < S; s += warps_per_group) {
    const float ls = lse_s[(long long)s * R];
    if (ls == kdtr::neg_inf()) continue;
    const float w = exp2f((ls - M) * kdtr::LOG2E);
    wsum += w;
    const float4 x = reinterpret_cast<const float4*>(ws_o + (((long long)b * S + s) * R + row) * KDTR_DV)[c4];
    acc.x += w * x.x;
    acc.y += w * x.y;
    acc.z += w * x.z;
    acc.w += w * x.w;
  }
  red[warp][4 * lane + 0] = acc.x;
  red[warp][4 * lane + 1] = acc.y;
  red[warp][4 * lane + 2] = acc.z;
  red[warp][4 * lane + 3] = acc.w;
  if (lane == 0) red[warp][128] = wsum;
  __syncthreads();
  float total = 0.f;  // every group saw every split once: the weights of group 0's warps
  for (int w = 0; w < COMBINE_WARPS; w += groups) total += red[w][128];
  const float inv = 1.f / total;
  OutT* out = static_cast<OutT*>(p.out) + ((long long)b * R + row) * KDTR_DV + col0;
  for (int c = 2 * threadIdx.x; c < cols; c += 2 * 32 * COMBINE_WARPS) {
    const int gc = c / 128, cc = c % 128;
    float x = 0.f, y = 0.f;
    for (int w = gc; w < COMBINE_WARPS; w += groups) {
      x += red[w][cc];
      y += red[w][cc + 1];
    }
    kdtr::store2<OutT>(out + c, x * inv, y * inv);
  }
  if (blockIdx.z == 0 && threadIdx.x == 0) p.lse[(long long)b * R + row] = M + logf(total);
}
