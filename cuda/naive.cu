// naive.cu -- the plain fp32 MLA tree-verify kernel: exact two-pass softmax.
//
// What it computes: out[b, t, h, :] and lse[b, t, h] of kdtr_abi.h's operator for any B, T, H,
// prefix lengths (0 .. 128k+) and page size, fp32 or bf16 storage, fp32 or bf16 output. All
// arithmetic is fp32 with accurate expf/logf (no fast math) in a fixed order, so re-runs are
// bit-identical. It is the readable baseline, not the fast kernel (that is flash.cu).
//
// How: a block owns ROWS = 16 consecutive query rows r = t * H + h of one request b (blockIdx.y)
// and walks that request's keys j = 0 .. P_b + T - 1 in tiles of KEYS = 16 cache rows, read
// through the block table and staged in shared memory as float. Thread (r, c) of the 16 x 16
// block scores row r against key c of the tile; key j is visible to node t iff j < P_b or bit
// j - P_b of the packed tree mask row t is set.
//   pass 1: per row, max m and sum l = sum exp(s - m) over the visible keys: each tile's max and
//           sum by half-warp reductions, merged into the running (m, l) with the exp rescale.
//   pass 2: recompute every score; p = exp(s - m) / l; out += p * v (v = key columns 0:512).
//           lse = m + log(l).
// Staging 16 rows per block lets each key tile serve 16 query rows: a 128k prefix with H = 16
// and T = 257 reads the cache 2 * 257 times (~155 GB fp32, mostly L2), not 2 * 4112 times.
//
// Planted bugs (kdtr/kernels/bugs.py gives the definitions) are compile-time branches on BUG
// (`if constexpr (BUG == ...)` or constexpr conditions); BUG = KDTR_BUG_NONE is the correct kernel. MERGE_WRONG_MAX processes each row's visible keys
// as two halves (ranks [0, n/2) and [n/2, n) in key order) with their own (m, l) and merges them
// without the exp(m_s - M) rescale; the correct kernel has a single softmax and no split.
//
// How to run: kdtr compiles it with NVRTC (-std=c++17, -I cuda/) and launches it with the
// geometry in kdtr_launch below, the same contract as a user kernel (see kdtr_abi.h):
//   kdtr verify -k naive ci                     the correct kernel on the committed goldens
//   kdtr verify -k naive-bug=no-rope ci         a planted bug (must FAIL)
//   pytest -m gpu tests/kernels/test_gpu_naive.py      GPU tests against a float64 reference
// Instantiations: kdtr_naive_verify<KvT, OutT, BUG>, KvT and OutT in {float, __nv_bfloat16},
// BUG a KdtrBug value (kdtr/kernels/registry.py's compile_targets() lists all of them).

#include <cuda_bf16.h>

#include "kdtr_abi.h"
#include "kdtr_common.cuh"

// ---- constants -------------------------------------------------------------------------------

namespace naive {
constexpr int ROWS = 16;                       // query rows (t, h) per block
constexpr int KEYS = 16;                       // cache rows per shared-memory key tile
constexpr int THREADS = ROWS * KEYS;           // thread (r, c) = (row, key) of a score tile
constexpr int MIN_BLOCKS = 2;                  // per SM for __launch_bounds__: <= 128 registers,
                                               // room for 32 accumulators without spills
constexpr int LD = KDTR_DK + 4;                // smem row stride in floats: float4-aligned, and
                                               // rows c, c+1 start 4 banks apart (no conflicts)
constexpr int VEC = 4;                         // elements per vector load / store
constexpr int VECS_PER_ROW = KDTR_DK / VEC;    // 144 float4 per 576-wide row
constexpr int OUT_VECS = KDTR_DV / VEC / KEYS; // 8 float4 of out per thread: cols 4 * (c + 16 i)
constexpr int SMEM_BYTES = ((ROWS + KEYS) * LD + ROWS * KEYS) * 4;  // q rows, key tile, probs
static_assert(SMEM_BYTES <= 99 * 1024, "fits sm_120's 99 KB of shared memory per block");
static_assert(KDTR_DK % VEC == 0 && KDTR_DV % (VEC * KEYS) == 0, "tile shape");
static_assert(KEYS <= 32 && 32 % KEYS == 0, "a row's KEYS threads sit in one warp");
static_assert((ROWS * VECS_PER_ROW) % THREADS == 0, "staging loops have no tail");
}  // namespace naive

// Launch geometry read by kdtr (kdtr_abi.h): {rows_per_block, threads, smem_bytes, num_splits}.
extern "C" __constant__ int kdtr_launch[4] = {naive::ROWS, naive::THREADS, naive::SMEM_BYTES, 1};

// ---- device helpers --------------------------------------------------------------------------

namespace naive {

// Stage ROWS x 576 elements into dst[ROWS][LD] as float. Row i comes from src + offset(i);
// rows with offset(i) < 0 are zero-filled (past the last query row / past the request's keys).
template <typename T, typename Offset>
__device__ __forceinline__ void stage_rows(const T* src, Offset offset, float* dst) {
  for (int i = threadIdx.x; i < ROWS * VECS_PER_ROW; i += THREADS) {
    const int row = i / VECS_PER_ROW, v = i % VECS_PER_ROW;
    const long long off = offset(row);
    const float4 x = off >= 0 ? kdtr::load_float4(src + off + v * VEC) : make_float4(0.f, 0.f, 0.f, 0.f);
    *reinterpret_cast<float4*>(dst + row * LD + v * VEC) = x;
  }
}

// Element offset of key j's cache row, or -1 past the request's keys (never visible).
template <int BUG>
__device__ __forceinline__ long long key_offset(const KdtrParams& p, int b, int j, int n_keys) {
  if (j >= n_keys) return -1;
  const int P = n_keys - p.T;
  if constexpr (BUG == KDTR_BUG_TAIL_POSITION) {
    return kdtr::kv_token_offset(p, b, j >= P ? j - P : j);  // tree node c at token c, not P + c
  } else if constexpr (BUG == KDTR_BUG_BLOCK_TABLE_STRIDE) {
    const int pages = (n_keys + p.page_size - 1) / p.page_size;  // the request's own page count as row stride
    return kdtr::kv_page_row(p, p.block_table[(long long)b * pages + j / p.page_size], j % p.page_size);
  } else if constexpr (BUG == KDTR_BUG_PAGE_OFF_BY_ONE) {
    // (j + 1) / page_size, clamped to the block-table row so the bug stays a wrong read, not a
    // read outside block_table (entries past a request's pages point at a NaN page).
    const int page_index = min((j + 1) / p.page_size, p.max_pages - 1);
    return kdtr::kv_row_offset(p, b, page_index, j % p.page_size);
  } else {
    return kdtr::kv_token_offset(p, b, j);
  }
}

// Is key j (in [0, P + T)) visible to node t of request b?
template <int BUG>
__device__ __forceinline__ bool is_visible(const KdtrParams& p, int b, int t, int P, int j) {
  if (j < P) {
    if constexpr (BUG == KDTR_BUG_DROP_PREFIX_KEY) {
      if (j == P - 1) return false;
    }
    if constexpr (BUG == KDTR_BUG_DROP_PARTIAL_TILE) {
      if (j >= KDTR_BUG_TILE * (P / KDTR_BUG_TILE)) return false;
    }
    return true;
  }
  const int c = j - P;  // tree node
  if constexpr (BUG == KDTR_BUG_SIBLING_VISIBLE) {
    if (c == t - 1) return true;
  }
  if constexpr (BUG == KDTR_BUG_CAUSAL_MASK) return c <= t;
  if constexpr (BUG == KDTR_BUG_NO_SELF) {
    if (c == t) return false;
  }
  if constexpr (BUG == KDTR_BUG_MASK_REQUEST0) return kdtr::mask_bit(p, 0, t, c);
  if constexpr (BUG == KDTR_BUG_MASK_BIT_ORDER) {
    return (kdtr::mask_row(p, b, t)[c / KDTR_MASK_BITS] >> (KDTR_MASK_BITS - 1 - c % KDTR_MASK_BITS)) & 1u;
  }
  if constexpr (BUG == KDTR_BUG_MASK_STRIDE) {  // the row stride of a T + 1-node mask; its last word past its end
    const long long at = ((long long)b * p.T + t) * (p.T / KDTR_MASK_BITS + 1) + c / KDTR_MASK_BITS;
    return (p.tree_mask[min(at, (long long)p.B * p.T * p.mask_words - 1)] >> (c % KDTR_MASK_BITS)) & 1u;
  }
  return kdtr::mask_bit(p, b, t, c);
}

// OUT_TRUNCATE: x rounded toward zero to a bf16 value (the float's top 16 bits).
__device__ __forceinline__ float truncate_bf16(float x) { return __uint_as_float(__float_as_uint(x) & 0xffff0000u); }

// q . k over the 576 columns (512 with the NO_ROPE bug), four interleaved fp32 partial sums.
template <int BUG>
__device__ __forceinline__ float dot_qk(const float* q, const float* k) {
  constexpr int D = (BUG == KDTR_BUG_NO_ROPE) ? KDTR_DV : KDTR_DK;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 4
  for (int d = 0; d < D; d += VEC) {
    const float4 a = *reinterpret_cast<const float4*>(q + d);
    const float4 x = *reinterpret_cast<const float4*>(k + d);
    acc.x = fmaf(a.x, x.x, acc.x);
    acc.y = fmaf(a.y, x.y, acc.y);
    acc.z = fmaf(a.z, x.z, acc.z);
    acc.w = fmaf(a.w, x.w, acc.w);
  }
  return (acc.x + acc.y) + (acc.z + acc.w);
}

// Fold a tile's (m2, l2) into the running softmax stats (m, l): both sums relative to the max.
__device__ __forceinline__ void merge_stats(float& m, float& l, float m2, float l2) {
  if (m2 == kdtr::neg_inf()) return;  // nothing visible in the tile
  const float mx = fmaxf(m, m2);
  l = l * expf(m - mx) + l2 * expf(m2 - mx);  // expf(-inf) = 0 before the first visible key
  m = mx;
}

// MERGE_WRONG_MAX only: the first key of the second half of node t's visible keys. The n
// visible keys in key order are the prefix 0..P-1 then the mask row's nodes; ranks >= n / 2
// form split 1.
__device__ __forceinline__ int second_half_start(const KdtrParams& p, int b, int t, int P) {
  const unsigned* mask = kdtr::mask_row(p, b, t);
  int n = P;
  for (int w = 0; w < p.mask_words; ++w) n += __popc(mask[w]);
  int rank = n / 2;
  if (rank < P) return rank;
  rank -= P;
  for (int w = 0; w < p.mask_words; ++w) {
    unsigned bits = mask[w];
    const int count = __popc(bits);
    if (rank < count) {
      for (; rank > 0; --rank) bits &= bits - 1;  // clear the lowest `rank` set bits
      return P + w * KDTR_MASK_BITS + __ffs(bits) - 1;
    }
    rank -= count;
  }
  return P + p.T;  // n == 0: no visible key at all
}

}  // namespace naive

// ---- kernel ----------------------------------------------------------------------------------

template <typename KvT, typename OutT, int BUG>
__global__ void __launch_bounds__(naive::THREADS, naive::MIN_BLOCKS) kdtr_naive_verify(const KdtrParams p) {
  using namespace naive;
  constexpr bool SPLIT = (BUG == KDTR_BUG_MERGE_WRONG_MAX);  // two softmax halves (the bug)

  extern __shared__ float4 smem_f4[];        // float4: 16-byte aligned
  float* q_s = reinterpret_cast<float*>(smem_f4);  // [ROWS][LD] this block's query rows
  float* k_s = q_s + ROWS * LD;              // [KEYS][LD] the current key tile
  float* p_s = k_s + KEYS * LD;              // [ROWS][KEYS] pass-2 probabilities of the tile

  const int b = blockIdx.y;
  const int rows = p.T * p.H;                // query rows of a request, r = t * H + h
  const int row0 = blockIdx.x * ROWS;
  const int r = threadIdx.x / KEYS;          // this thread's row in the block ...
  const int c = threadIdx.x % KEYS;          // ... and key in a tile
  const int row = row0 + r;
  const bool row_ok = row < rows;
  const int t = row_ok ? row / p.H : 0;
  const int P = p.prefix_lens[b];
  const int n_keys = P + p.T;
  // MISSING_LOG2E: an exp2-domain kernel without log2(e) computes the operator at scale * ln 2
  const float scale = (BUG == KDTR_BUG_SCALE_OFF) ? p.scale * 1.01f : (BUG == KDTR_BUG_MISSING_LOG2E) ? p.scale * kdtr::LN2 : p.scale;
  const KvT* kv = static_cast<const KvT*>(p.kv_cache);

  if constexpr (BUG == KDTR_BUG_Q_HEAD_MAJOR) {  // row (t, h) read from row h * T + t
    auto q_row = [&](int rr) { return rr % p.H * p.T + rr / p.H; };
    stage_rows(static_cast<const KvT*>(p.q),
               [&](int i) { return row0 + i < rows ? ((long long)b * rows + q_row(row0 + i)) * KDTR_DK : -1LL; }, q_s);
  } else {
    stage_rows(static_cast<const KvT*>(p.q),
               [&](int i) { return row0 + i < rows ? ((long long)b * rows + row0 + i) * KDTR_DK : -1LL; },
               q_s);
  }
  const int split_j = (SPLIT && row_ok) ? second_half_start(p, b, t, P) : n_keys;

  // ---- pass 1: max and sum of exp over the visible keys (per split with the bug) ------------
  float m0 = kdtr::neg_inf(), l0 = 0.f;  // keys j < split_j (all keys for the correct kernel)
  float m1 = kdtr::neg_inf(), l1 = 0.f;  // keys j >= split_j (MERGE_WRONG_MAX only)
  for (int j0 = 0; j0 < n_keys; j0 += KEYS) {
    __syncthreads();  // q_s staged / the previous tile consumed
    stage_rows(kv, [&](int i) { return key_offset<BUG>(p, b, j0 + i, n_keys); }, k_s);
    __syncthreads();
    const int j = j0 + c;
    const bool vis = row_ok && j < n_keys && is_visible<BUG>(p, b, t, P, j);
    const float s = vis ? scale * dot_qk<BUG>(q_s + r * LD, k_s + c * LD) : kdtr::neg_inf();
    const bool first = j < split_j;
    {
      const float x = first ? s : kdtr::neg_inf();
      const float tx = kdtr::warp_max<KEYS>(x);  // NO_RUNNING_MAX: 0 wherever a key is visible
      const float tm = BUG == KDTR_BUG_NO_RUNNING_MAX && tx != kdtr::neg_inf() ? 0.f : tx;
      const float tl = kdtr::warp_sum<KEYS>(x == kdtr::neg_inf() ? 0.f : expf(x - tm));
      merge_stats(m0, l0, tm, tl);
    }
    if constexpr (SPLIT) {
      const float x = first ? kdtr::neg_inf() : s;
      const float tm = kdtr::warp_max<KEYS>(x);
      const float tl = kdtr::warp_sum<KEYS>(x == kdtr::neg_inf() ? 0.f : expf(x - tm));
      merge_stats(m1, l1, tm, tl);
    }
  }
  // The bug adds the halves' sums as if both were relative to one max (no exp(m_s - M)).
  const float denom = SPLIT ? l0 + l1 : l0;

  // ---- pass 2: out = sum_j exp(s_j - m) / l * v_j, scores recomputed -------------------------
  float4 acc[OUT_VECS];
#pragma unroll
  for (int i = 0; i < OUT_VECS; ++i) acc[i] = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int j0 = 0; j0 < n_keys; j0 += KEYS) {
    __syncthreads();  // the previous tile and its probabilities consumed
    stage_rows(kv, [&](int i) { return key_offset<BUG>(p, b, j0 + i, n_keys); }, k_s);
    __syncthreads();
    const int j = j0 + c;
    float prob = 0.f;
    if (row_ok && j < n_keys && is_visible<BUG>(p, b, t, P, j)) {
      const float s = scale * dot_qk<BUG>(q_s + r * LD, k_s + c * LD);
      const float m = (SPLIT && j >= split_j) ? m1 : m0;
      prob = expf(s - m) / denom;
    }
    p_s[r * KEYS + c] = prob;
    __syncthreads();
    for (int cc = 0; cc < KEYS; ++cc) {
      const float w = p_s[r * KEYS + cc];
      if (w == 0.f) continue;  // invisible (or underflowed) key: adds nothing
      const float* v = k_s + cc * LD + VEC * c + (BUG == KDTR_BUG_V_COLUMNS ? KDTR_DROPE : 0);
#pragma unroll
      for (int i = 0; i < OUT_VECS; ++i) {
        const float4 x = *reinterpret_cast<const float4*>(v + VEC * KEYS * i);
        acc[i].x = fmaf(w, x.x, acc[i].x);
        acc[i].y = fmaf(w, x.y, acc[i].y);
        acc[i].z = fmaf(w, x.z, acc[i].z);
        acc[i].w = fmaf(w, x.w, acc[i].w);
      }
    }
  }

  if (!row_ok) return;
  OutT* out = static_cast<OutT*>(p.out) + ((long long)b * rows + row) * KDTR_DV + VEC * c;
#pragma unroll
  for (int i = 0; i < OUT_VECS; ++i) {
    OutT* o = out + VEC * KEYS * i;
    if constexpr (BUG == KDTR_BUG_OUT_TRUNCATE && sizeof(OutT) == 2) {  // bf16 out rounded toward zero
      acc[i] = make_float4(truncate_bf16(acc[i].x), truncate_bf16(acc[i].y), truncate_bf16(acc[i].z), truncate_bf16(acc[i].w));
    }
    o[0] = kdtr::from_float<OutT>(acc[i].x);
    o[1] = kdtr::from_float<OutT>(acc[i].y);
    o[2] = kdtr::from_float<OutT>(acc[i].z);
    o[3] = kdtr::from_float<OutT>(acc[i].w);
  }
  if (c == 0) {
    const float m = SPLIT ? fmaxf(m0, m1) : m0;
    const float lse = m + logf(denom);
    p.lse[(long long)b * rows + row] = BUG == KDTR_BUG_LSE_LOG2 ? lse * kdtr::LOG2E : lse;
  }
}
