// flash_sm90.cu -- the Hopper kernel: tree-verify MLA attention on wgmma (sm_90a only).
//
// What is in it
//   kdtr_flash90_verify<OutT, BUG>   one CTA = 64 query rows of one request (rows r = node*H + head)
//                                    x one KV split of that request; 2 warpgroups, 256 threads.
//   kdtr_flash_combine<OutT>         the split merge shared with flash_verify.cu (flash_combine.cuh).
//
// Design (SPEC sections 1, 3, 5; the same operator, split plan and workspace as flash_verify.cu)
//   * wgmma.mma_async (m64nNk16, bf16 in, fp32 accumulate): the tensor cores read the KV tile
//     straight from shared memory for both products, which mma.sync cannot do at this width (its
//     B fragments go through the register file; docs/PERF.md).
//   * KV tiles of BN = 16 keys x 576 come in through cp.async, STAGES = 4 deep (18 KB each), in the
//     wgmma 128-byte-swizzle layout: 9 slabs of 64 columns, key k's 128-byte row of a slab at
//     k * 128 with its 16-byte chunks XOR-ed by k % 8. A quarter warp copies one such row (whole
//     lines from global memory, conflict-free stores). The same bytes are the K-major B of
//     S = Q K^T and the MN-major B of O = P V: only the descriptors differ.
//   * Q stays in registers as wgmma A fragments: warpgroup w holds columns w*288..+288 of all 64
//     rows (72 registers) and computes a partial S[64 x 16]; the two partials are swapped through
//     8 KB of shared memory, so both warpgroups hold the full S and run the same online softmax.
//   * O[64 x 512] is split by columns: warpgroup w accumulates O[:, w*256..+256] (128 fp32
//     registers per thread), P coming from registers (the S accumulator layout is the A layout).
//   * Overlap: while the softmax of tile i runs on the CUDA cores, the tensor cores compute S of
//     tile i+1; the swap of S(i+1) runs while P V of tile i is in flight.
//   * Tree tail in the same pass: only tail tiles some row of the CTA sees are loaded; each row's
//     mask word decides visibility. Full prefix tiles skip the mask arithmetic.
//   Shared memory: 4 x 18 432 (KV) + 1 KB alignment + 8 KB (S swap) + tile list = ~83 KB, within
//   sm_120's 99 KB like every kdtr kernel (static_assert), though only sm_90a has wgmma.
//
// How to run
//   kdtr verify -k flash-sm90 ci     correctness on the committed goldens (needs an sm_90 GPU)
//   kdtr bench  -k flash-sm90 --model deepseek-v3 --tp 8 --budget 64,256 --prefix 8k,32k
//   Compiled for sm_90a only (kdtr.kernels.compile_targets); the launch plan is kdtr/flash.py's.
//   Experiment knobs (NVRTC -D, e.g. through scripts/sm90_ablate.py; add -DKDTR_F90_EXPERIMENT to
//   lift the 99 KB assert): KDTR_F90_BN=16|32, KDTR_F90_STAGES=2 (serial) or >= 3 (overlapped),
//   KDTR_F90_SCHAINS=1|2 (independent accumulator chains of S).

#include <cuda_bf16.h>

#include "kdtr_abi.h"
#include "kdtr_common.cuh"
#include "flash_combine.cuh"

// ---------------------------------------------------------------------------------------------
// constants
// ---------------------------------------------------------------------------------------------
namespace f90 {

#ifndef KDTR_F90_BN
#define KDTR_F90_BN 32
#endif
#ifndef KDTR_F90_STAGES
#define KDTR_F90_STAGES 2
#endif
#ifndef KDTR_F90_SCHAINS
#define KDTR_F90_SCHAINS 1
#endif

constexpr int BM = 64;                          // query rows per CTA (the wgmma M)
constexpr int BN = KDTR_F90_BN;                 // keys per KV tile (16 or 32)
constexpr int STAGES = KDTR_F90_STAGES;         // cp.async pipeline depth: 2 serial, >= 3 overlapped
constexpr bool OVERLAP = STAGES >= 3;           // S(i+1) issued before the softmax of tile i
constexpr int SCHAINS = KDTR_F90_SCHAINS;       // independent accumulator chains of S (1 or 2)
constexpr int NTHREADS = 256;                   // two warpgroups
constexpr int KSTEPS_WG = KDTR_DK / 16 / 2;     // 18 k-steps of S per warpgroup
constexpr int SLABS = KDTR_DK / 64;             // 9 slabs of 64 columns (128-byte swizzle rows)
constexpr int SLAB = BN * 128;                  // bytes of one slab of a tile
constexpr int STAGE_BYTES = SLABS * SLAB;       // 18 432
constexpr int S_REGS = BM * BN / 128;           // 8 fp32 of S per thread
constexpr int O_REGS = BM * (KDTR_DV / 2) / 128;  // 128 fp32 of O per thread
constexpr int TILES_PER_WORD = KDTR_MASK_BITS / BN;
constexpr int MAX_T = 1280;                     // tree nodes supported (tail-tile list size)
constexpr int MAX_TAIL_TILES = MAX_T / BN;      // 80

struct Smem {                                   // byte offsets into dynamic shared memory
  static constexpr int kv = 0;                                     // bf16 [STAGES][SLABS][BN][64], swizzled
  static constexpr int swap = kv + STAGES * STAGE_BYTES + 1024;    // float [2 wg][S_REGS][128]; 1 KB: kv alignment
  static constexpr int live = swap + 2 * S_REGS * 128 * 4;         // int [MAX_TAIL_TILES] 0/1
  static constexpr int tiles = live + MAX_TAIL_TILES * 4;          // int [MAX_TAIL_TILES] live tail tiles
  static constexpr int count = tiles + MAX_TAIL_TILES * 4;         // int
  static constexpr int bytes = count + 16;
};
#if !defined(KDTR_F90_EXPERIMENT)
static_assert(Smem::bytes <= 99 * 1024, "shared memory per block must stay within sm_120's 99 KB");
#endif
static_assert((BN == 16 || BN == 32) && STAGES >= 2 && (SCHAINS == 1 || SCHAINS == 2), "unsupported knobs");
static_assert(STAGE_BYTES % 1024 == 0, "every stage starts on a 128-byte-swizzle atom");

}  // namespace f90

// Read by kdtr/flash.py (module.get_global) so the launcher never restates these numbers.
extern "C" __constant__ int kdtr_flash90_config[6] = {f90::BN, f90::STAGES, f90::MAX_T, f90::Smem::bytes,
                                                      f90::NTHREADS, 32 * COMBINE_WARPS};

// ---------------------------------------------------------------------------------------------
// device helpers (PTX wrappers)
// ---------------------------------------------------------------------------------------------
namespace f90 {

// Shared-memory matrix descriptor, 128-byte swizzle: start address, LBO and SBO in bytes (PTX ISA,
// "Matrix Descriptor Format"; 16-byte units). K-major: SBO = 8-row group stride (LBO unused);
// MN-major: LBO = stride between 64-wide column blocks, SBO = 8-row (K) group stride.
__device__ __forceinline__ unsigned long long desc_sw128(unsigned addr, unsigned lbo, unsigned sbo) {
  return (unsigned long long)((addr >> 4) & 0x3FFFu) | ((unsigned long long)((lbo >> 4) & 0x3FFFu) << 16) |
         ((unsigned long long)((sbo >> 4) & 0x3FFFu) << 32) | (1ull << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
// cp.async writes (generic proxy) made visible to wgmma reads (async proxy); before the barrier.
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// Keep the compiler from touching accumulators across an in-flight wgmma.
template <int N>
__device__ __forceinline__ void reg_fence(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const unsigned*>(&v);
}

// 2^x on the SFU, flushing denormals (P and alpha need no more).
__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// D[64 x 16] (+)= A[64 x 16] (registers) * B[16 x 16] (shared, descriptor); TRANS_B: B is MN-major.
template <int TRANS_B>
__device__ __forceinline__ void wgmma_m64n16k16(float (&d)[8], const unsigned (&a)[4], unsigned long long desc, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 "
      "{%0,%1,%2,%3,%4,%5,%6,%7}, "
      "{%8,%9,%10,%11}, %12, p, 1, 1, %14;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(accumulate), "n"(TRANS_B));
}

// D[64 x 32] (+)= A[64 x 16] (registers) * B[16 x 32] (shared, descriptor); TRANS_B: B is MN-major.
template <int TRANS_B>
__device__ __forceinline__ void wgmma_m64n32k16(float (&d)[16], const unsigned (&a)[4], unsigned long long desc, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, "
      "{%16,%17,%18,%19}, %20, p, 1, 1, %22;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(accumulate), "n"(TRANS_B));
}

// D[64 x 256] (+)= A[64 x 16] (registers) * B[16 x 256] (shared, descriptor); TRANS_B: B is MN-major.
template <int TRANS_B>
__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], const unsigned (&a)[4], unsigned long long desc, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
      "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
      "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"
      "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,"
      "%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,"
      "%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,"
      "%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,"
      "%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127}, "
      "{%128,%129,%130,%131}, %132, p, 1, 1, %134;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
        "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
        "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
        "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
        "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
        "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
        "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(accumulate), "n"(TRANS_B));
}

// S tile of BN keys: one wgmma per k-step.
template <int N>
__device__ __forceinline__ void wgmma_s(float (&d)[N / 2], const unsigned (&a)[4], unsigned long long desc, int accumulate) {
  if constexpr (N == 16) wgmma_m64n16k16<0>(d, a, desc, accumulate);
  else wgmma_m64n32k16<0>(d, a, desc, accumulate);
}

}  // namespace f90

// ---------------------------------------------------------------------------------------------
// kernels
// ---------------------------------------------------------------------------------------------
template <typename OutT, int BUG>
__global__ void __launch_bounds__(f90::NTHREADS, 1) kdtr_flash90_verify(const KdtrParams p) {
  using namespace f90;
  using kdtr::LN2;
  using kdtr::LOG2E;

  extern __shared__ __align__(128) unsigned char smem[];
  float* swap = reinterpret_cast<float*>(smem + Smem::swap);
  int* live = reinterpret_cast<int*>(smem + Smem::live);
  int* tail_tiles = reinterpret_cast<int*>(smem + Smem::tiles);
  int* n_tail_s = reinterpret_cast<int*>(smem + Smem::count);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int wg = warp >> 2, wtid = tid & 127, ww = warp & 3;  // warpgroup, thread and warp in it
  const int g = lane >> 2, tq = lane & 3;
  const int b = blockIdx.z, split = blockIdx.y, nsplit = p.num_splits;
  const int H = p.H, T = p.T, R = T * H, W = p.mask_words;
  const int r0 = blockIdx.x * BM;
  const int P = p.prefix_lens[b];
  const __nv_bfloat16* kv = static_cast<const __nv_bfloat16*>(p.kv_cache);
  const unsigned* mask_b = p.tree_mask + (long long)b * T * W;

  // ---- this CTA's keys: prefix range [kp_lo, kp_hi) of its split, plus the tail if last ----
  const int split_len = max(BN, ((P + nsplit - 1) / nsplit + BN - 1) / BN * BN);
  const int kp_lo = min(P, split * split_len);
  int kp_hi = min(P, kp_lo + split_len);
  if (BUG == KDTR_BUG_DROP_PARTIAL_TILE) kp_hi = max(kp_lo, min(kp_hi, P / KDTR_BUG_TILE * KDTR_BUG_TILE));
  if (BUG == KDTR_BUG_DROP_PREFIX_KEY && P > 0 && kp_hi == P) kp_hi = max(kp_lo, P - 1);
  const int n_pre = (kp_hi - kp_lo + BN - 1) / BN;
  const bool has_tail = split == nsplit - 1;

  // ---- live tail tiles: nodes BN*w..BN*w+BN-1 some row of this CTA sees ----
  if (tid < MAX_TAIL_TILES) live[tid] = 0;
  __syncthreads();
  if (has_tail) {
    const int t_lo = r0 / H, t_hi = (min(R, r0 + BM) - 1) / H;
    for (int idx = tid; idx < (t_hi - t_lo + 1) * W; idx += NTHREADS) {
      const int t = t_lo + idx / W, w = idx % W;
      unsigned word = mask_b[(long long)t * W + w];
      if (BUG == KDTR_BUG_SIBLING_VISIBLE && t >= 1 && (t - 1) / 32 == w) word |= 1u << ((t - 1) % 32);
#pragma unroll
      for (int q = 0; q < TILES_PER_WORD; ++q)
        if ((word >> (q * BN)) & (0xFFFFFFFFu >> (32 - BN))) live[w * TILES_PER_WORD + q] = 1;
    }
  }
  __syncthreads();
  if (tid == 0) {
    int n = 0;
    for (int w = 0; w * BN < T && w < MAX_TAIL_TILES; ++w)
      if (live[w]) tail_tiles[n++] = w;
    *n_tail_s = has_tail ? n : 0;
  }
  __syncthreads();
  const int n_tiles = n_pre + *n_tail_s;
  // first key of tile i: prefix tiles from kp_lo, tail tile w at P + BN w
  auto tile_key0 = [&](int i) { return i < n_pre ? kp_lo + i * BN : P + tail_tiles[i - n_pre] * BN; };

  // ---- KV tile loads: a quarter warp copies one (key, slab) row of 128 bytes; each thread keeps
  // one key, so its block-table read (issued a tile ahead, see src_next) is one per tile ----
  const int ld_row = tid >> 3, ld_chunk = tid & 7;
  const int ld_key = ld_row % BN, ld_slab0 = ld_row / BN;
  constexpr int SLAB_STEP = NTHREADS / 8 / BN;
  const unsigned kv_base = (kdtr::smem_addr(smem) + Smem::kv + 1023u) & ~1023u;  // swizzle atoms: 1 KB
  auto locate = [&](int i) -> const __nv_bfloat16* {  // the row of key ld_key of tile i, or nullptr
    if (i >= n_tiles) return nullptr;
    const int j = tile_key0(i) + ld_key;
    if (j >= (i < n_pre ? kp_hi : P + T)) return nullptr;  // past the range: zero-filled
    const int page_index = min((BUG == KDTR_BUG_PAGE_OFF_BY_ONE ? j + 1 : j) / p.page_size, p.max_pages - 1);
    return kv + kdtr::kv_row_offset(p, b, page_index, j % p.page_size);
  };
  auto load_tile = [&](const __nv_bfloat16* src, int stage) {
    const bool valid = src != nullptr;
    const unsigned dst = kv_base + stage * STAGE_BYTES + ld_key * 128 + ((ld_chunk ^ (ld_key & 7)) * 16);
#pragma unroll
    for (int sl = ld_slab0; sl < SLABS; sl += SLAB_STEP)
      kdtr::cp_async16(dst + sl * SLAB, valid ? src + sl * 64 + ld_chunk * 8 : kv, valid);
  };

  // ---- Q as wgmma A fragments: rows ww*16 + g (+8), columns of this warpgroup's k-steps ----
  unsigned qf[KSTEPS_WG][4];
  {
    const __nv_bfloat16* qb = static_cast<const __nv_bfloat16*>(p.q) + (long long)b * R * KDTR_DK;
    const int ra = r0 + ww * 16 + g, rb = ra + 8;
#pragma unroll
    for (int ks = 0; ks < KSTEPS_WG; ++ks) {
      const int k = (wg * KSTEPS_WG + ks) * 16 + 2 * tq;
      if (BUG == KDTR_BUG_NO_ROPE && k >= KDTR_DV) {  // the planted bug: q.k over the latent columns only
        qf[ks][0] = qf[ks][1] = qf[ks][2] = qf[ks][3] = 0u;
        continue;
      }
      qf[ks][0] = ra < R ? kdtr::ld_u32(qb + (long long)ra * KDTR_DK + k) : 0u;
      qf[ks][1] = rb < R ? kdtr::ld_u32(qb + (long long)rb * KDTR_DK + k) : 0u;
      qf[ks][2] = ra < R ? kdtr::ld_u32(qb + (long long)ra * KDTR_DK + k + 8) : 0u;
      qf[ks][3] = rb < R ? kdtr::ld_u32(qb + (long long)rb * KDTR_DK + k + 8) : 0u;
    }
  }

  // S partial of tile i (this warpgroup's 288 columns), issued, not waited for: K-major B
  // (SCHAINS = 2: even and odd k-steps in two accumulators, summed by finish_s)
  float s_alt[S_REGS];  // unused (and optimised away) with one chain
  auto issue_s = [&](float (&s)[S_REGS], int i) {
    const unsigned tile = kv_base + (i % STAGES) * STAGE_BYTES;
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < KSTEPS_WG; ++ks) {
      const int kstep = wg * KSTEPS_WG + ks;
      const unsigned long long d = desc_sw128(tile + (kstep >> 2) * SLAB + (kstep & 3) * 32, 16, 1024);
      if constexpr (SCHAINS == 2) {
        if (ks & 1) wgmma_s<BN>(s_alt, qf[ks], d, ks > 1);
        else wgmma_s<BN>(s, qf[ks], d, ks > 0);
      } else {
        wgmma_s<BN>(s, qf[ks], d, ks > 0);
      }
    }
    wgmma_commit();
  };
  auto finish_s = [&](float (&s)[S_REGS]) {  // after the wgmma wait
    reg_fence(s);
    if constexpr (SCHAINS == 2) {
      reg_fence(s_alt);
#pragma unroll
      for (int e = 0; e < S_REGS; ++e) s[e] += s_alt[e];
    }
  };
  // full S from the two partials: thread wtid of one warpgroup holds the same (row, key) slots as
  // in the other; the caller guarantees the previous swap was read by everyone ([A])
  auto swap_s = [&](float (&s)[S_REGS]) {
#pragma unroll
    for (int e = 0; e < S_REGS; ++e) swap[(wg * S_REGS + e) * 128 + wtid] = s[e];
    __syncthreads();  // [B]
#pragma unroll
    for (int e = 0; e < S_REGS; ++e) s[e] += swap[((1 - wg) * S_REGS + e) * 128 + wtid];
  };

  // ---- softmax state of this thread's two rows (half 0: row g, half 1: row g + 8) ----
  const int srow0 = r0 + ww * 16 + g;  // row of half h: srow0 + 8 h (recomputed, not held: registers)
  const float sc = p.scale * LOG2E * (BUG == KDTR_BUG_SCALE_OFF ? 1.01f : 1.0f);
  float m_run[2] = {kdtr::neg_inf(), kdtr::neg_inf()}, l_run[2] = {0.f, 0.f};  // l: this thread's columns only

  float acc[O_REGS];
#pragma unroll
  for (int e = 0; e < O_REGS; ++e) acc[e] = 0.f;

  // ---- the softmax of S(i) (in s_cur), then O += P V(i) issued and left in flight ----
  float s_cur[S_REGS], s_nxt[S_REGS];  // s_nxt: the overlapped pipeline only
  auto softmax_pv = [&](int i) {
    // mask + online softmax of S(i) (exp2 domain); element e: n8 block e/4, row half (e/2)%2,
    // column pair e%2
    const int key0 = tile_key0(i);
    if (i >= n_pre) {  // tail tile: the mask word of each row
      const int n0 = key0 - P, w = n0 / KDTR_MASK_BITS;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        unsigned x = 0u;
        if (srow0 + 8 * h < R) {
          const int t = (srow0 + 8 * h) / H;
          x = mask_b[(long long)t * W + w];
          if (BUG == KDTR_BUG_SIBLING_VISIBLE && t >= 1 && (t - 1) / 32 == w) x |= 1u << ((t - 1) % 32);
          x >>= n0 % KDTR_MASK_BITS;
          if (T - n0 < 32) x &= (1u << (T - n0)) - 1u;  // nodes past T are never visible
        }
#pragma unroll
        for (int e = 2 * h; e < S_REGS; e += (e & 1) ? 3 : 1) {  // elements of row half h
          const int col = (e >> 2) * 8 + 2 * tq + (e & 1);
          s_cur[e] = ((x >> col) & 1u) ? s_cur[e] * sc : kdtr::neg_inf();
        }
      }
    } else if (key0 + BN > kp_hi || srow0 + 8 >= R) {  // the last, partial prefix tile, or rows past R
#pragma unroll
      for (int e = 0; e < S_REGS; ++e) {
        const int h = (e >> 1) & 1, col = (e >> 2) * 8 + 2 * tq + (e & 1);
        s_cur[e] = (srow0 + 8 * h < R && key0 + col < kp_hi) ? s_cur[e] * sc : kdtr::neg_inf();
      }
    } else {  // a full prefix tile: every key visible
#pragma unroll
      for (int e = 0; e < S_REGS; ++e) s_cur[e] *= sc;
    }
    float mx[2] = {kdtr::neg_inf(), kdtr::neg_inf()};
#pragma unroll
    for (int e = 0; e < S_REGS; ++e) mx[(e >> 1) & 1] = fmaxf(mx[(e >> 1) & 1], s_cur[e]);
    float alpha[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float m_new = fmaxf(m_run[h], kdtr::warp_max<4>(mx[h]));
      const float m_use = m_new == kdtr::neg_inf() ? 0.f : m_new;
      alpha[h] = ex2(m_run[h] - m_use);
      m_run[h] = m_new;
      mx[h] = m_use;
    }
    float psum[2] = {0.f, 0.f};
#pragma unroll
    for (int e = 0; e < S_REGS; ++e) {
      const int h = (e >> 1) & 1;
      s_cur[e] = ex2(s_cur[e] - mx[h]);
      psum[h] += s_cur[e];
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) l_run[h] = l_run[h] * alpha[h] + psum[h];
    if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {  // the max rarely moves late
#pragma unroll
      for (int e = 0; e < O_REGS; ++e) acc[e] *= alpha[(e >> 1) & 1];
    }

    // O[:, wg*256..+256] += P(i) V(i): P as A fragments (k-step kk: keys 16kk.. = S n8 blocks
    // 2kk, 2kk+1); V MN-major, LBO = slab stride (64 columns), SBO = 8 keys
    {
      const unsigned tile = kv_base + (i % STAGES) * STAGE_BYTES;
      unsigned pa[BN / 16][4];
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk) {
        pa[kk][0] = pack_bf16(s_cur[8 * kk + 0], s_cur[8 * kk + 1]);
        pa[kk][1] = pack_bf16(s_cur[8 * kk + 2], s_cur[8 * kk + 3]);
        pa[kk][2] = pack_bf16(s_cur[8 * kk + 4], s_cur[8 * kk + 5]);
        pa[kk][3] = pack_bf16(s_cur[8 * kk + 6], s_cur[8 * kk + 7]);
      }
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < BN / 16; ++kk)
        wgmma_m64n256k16<1>(acc, pa[kk], desc_sw128(tile + wg * 4 * SLAB + kk * 2048, SLAB, 1024), 1);
      wgmma_commit();
    }
  };

  // ---- pipeline: tile t is cp.async group t; the prologue loads tiles 0..STAGES-2 ----
#pragma unroll
  for (int st = 0; st < STAGES - 1; ++st) {
    load_tile(locate(st), st);  // a split past a short prefix may have no key at all: zero-filled
    kdtr::cp_async_commit();
  }
  const __nv_bfloat16* src_next = locate(STAGES - 1);
  auto next_load = [&](int i) {  // at iteration i: tile i+STAGES-1 into the stage of tile i-1
    const int nx = i + STAGES - 1;
    if (nx < n_tiles) load_tile(src_next, nx % STAGES);
    kdtr::cp_async_commit();
    src_next = locate(nx + 1);
  };

  if constexpr (!OVERLAP) {
    // serial: [A] tile i resident, P V(i-1) done by both warpgroups; S(i); swap; softmax; P V(i)
    for (int i = 0; i < n_tiles; ++i) {
      wgmma_wait<0>();
      reg_fence(acc);
      kdtr::cp_async_wait<STAGES - 2>();
      fence_async_smem();
      __syncthreads();  // [A]
      next_load(i);
      issue_s(s_cur, i);
      wgmma_wait<0>();
      finish_s(s_cur);
      swap_s(s_cur);
      softmax_pv(i);
    }
  } else {
    // overlapped: S(i+1) on the tensor cores while the softmax of tile i runs
    if (n_tiles > 0) {
      kdtr::cp_async_wait<STAGES - 2>();
      fence_async_smem();
      __syncthreads();
      issue_s(s_cur, 0);
      wgmma_wait<0>();
      finish_s(s_cur);
      swap_s(s_cur);
    }
    for (int i = 0; i < n_tiles; ++i) {
      // [A] tile i+1 resident; P V(i-1) done in both warpgroups (its stage is free); swap of S(i) read
      wgmma_wait<0>();
      reg_fence(acc);
      kdtr::cp_async_wait<STAGES - 3>();
      fence_async_smem();
      __syncthreads();
      next_load(i);
      const bool more = i + 1 < n_tiles;
      if (more) issue_s(s_nxt, i + 1);
      softmax_pv(i);
      wgmma_wait<0>();  // S(i+1) and P V(i)
      reg_fence(acc);
      if (more) {
        finish_s(s_nxt);
        swap_s(s_nxt);
#pragma unroll
        for (int e = 0; e < S_REGS; ++e) s_cur[e] = s_nxt[e];
      }
    }
  }
  wgmma_wait<0>();
  reg_fence(acc);
  kdtr::cp_async_wait<0>();

  // ---- epilogue: out (one split) or fp32 partials + lse (several) ----
  const bool direct = nsplit == 1;
  float* ws_o = static_cast<float*>(p.workspace);
  float* ws_lse = ws_o + (long long)p.B * nsplit * R * KDTR_DV;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float l = kdtr::warp_sum<4>(l_run[h]), m = m_run[h];
    const int r = srow0 + 8 * h;
    if (r >= R) continue;
    const float inv = l > 0.f ? 1.f / l : 0.f;
    const long long orow = direct ? ((long long)b * R + r) * KDTR_DV : (((long long)b * nsplit + split) * R + r) * KDTR_DV;
#pragma unroll
    for (int j = 0; j < O_REGS / 4; ++j) {
      const int col = wg * (KDTR_DV / 2) + j * 8 + 2 * tq;
      const float o0 = acc[4 * j + 2 * h] * inv, o1 = acc[4 * j + 2 * h + 1] * inv;
      if (direct) kdtr::store2<OutT>(static_cast<OutT*>(p.out) + orow + col, o0, o1);
      else kdtr::store2<float>(ws_o + orow + col, o0, o1);
    }
    if (wg == 0 && tq == 0) {
      // lse in natural log; the planted merge bug drops the max from the partials' lse
      const float lse2 = BUG == KDTR_BUG_MERGE_WRONG_MAX && !direct ? log2f(l) : m + log2f(l);
      const float lse = l > 0.f ? lse2 * LN2 : kdtr::neg_inf();
      if (direct) p.lse[(long long)b * R + r] = lse;
      else ws_lse[((long long)b * nsplit + split) * R + r] = lse;
    }
  }
}
