// flash_sm90_ops.cuh -- flash_sm90.cu's device helpers: the PTX it issues (wgmma and its shared-memory
// descriptors, mbarriers, TMA, named barriers, setmaxnreg), Q's fragment loads and the tail-tile scan.
//
// Included by flash_sm90.cu only, after its constants (namespace flash_sm90), Smem and KvTensorMap, which these
// helpers use; sm_90a only. `kdtr compile -k flash-sm90` builds it.
#pragma once

#include <cuda_bf16.h>

#include "kdtr_abi.h"
#include "kdtr_common.cuh"
#include "flash_split.cuh"

// ---------------------------------------------------------------------------------------------
// device helpers (PTX wrappers)
// ---------------------------------------------------------------------------------------------
namespace flash_sm90 {

// Shared-memory matrix descriptor, 128-byte swizzle: start address, LBO and SBO in bytes (PTX ISA,
// "Matrix Descriptor Format"; 16-byte units). K-major: SBO = 8-row group stride (LBO unused);
// MN-major: LBO = stride between 64-wide column blocks, SBO = 8-row (K) group stride.
// No swizzle (P): core matrices of 8 rows x 16 bytes; LBO = stride along K, SBO = along M.
__device__ __forceinline__ unsigned long long desc_make(unsigned addr, unsigned lbo, unsigned sbo, bool sw128) {
  return (unsigned long long)((addr >> 4) & 0x3FFFu) | ((unsigned long long)((lbo >> 4) & 0x3FFFu) << 16) |
         ((unsigned long long)((sbo >> 4) & 0x3FFFu) << 32) | (sw128 ? 1ull << 62 : 0ull);
}
__device__ __forceinline__ unsigned long long desc_sw128(unsigned addr, unsigned lbo, unsigned sbo) {
  return desc_make(addr, lbo, sbo, true);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
// cp.async writes (generic proxy) made visible to wgmma reads (async proxy); before the barrier.
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

// mbarriers (a TMA tile's completion: one arrival with the byte count, then the bytes)
__device__ __forceinline__ void mbar_init(unsigned bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
__device__ __forceinline__ void mbar_expect_tx(unsigned bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned bar, unsigned parity) {
  asm volatile(
      "{\n.reg .pred done;\nKDTR_MBAR_WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra KDTR_MBAR_WAIT;\n}\n" ::"r"(bar), "r"(parity) : "memory");
}
// One TMA box (coordinates c0, c1, c2 of the tensor map) into shared memory at dst; completes on bar.
__device__ __forceinline__ void tma_load_3d(unsigned dst, const KvTensorMap* map, int c0, int c1, int c2, unsigned bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n"
      ::"r"(dst), "l"(reinterpret_cast<unsigned long long>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(bar) : "memory");
}

// named barriers: every warp of the `count` threads calls one of the two
__device__ __forceinline__ void bar_sync(int id, int count) { asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory"); }
__device__ __forceinline__ void bar_arrive(int id, int count) { asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory"); }

template <int N>
__device__ __forceinline__ void set_max_regs_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N)); }
template <int N>
__device__ __forceinline__ void set_max_regs_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N)); }

// Keep the compiler from touching accumulators across an in-flight wgmma.
template <int N>
__device__ __forceinline__ void reg_fence(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// 2^x on the SFU, flushing denormals (P and alpha need no more).
__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// The producer's online softmax of S's row half h (elements e = 4 j + 2 h + {0, 1}, j = 0..3) in two steps that both
// orders in the kernel share: the row's running maximum after this tile (a quad's 4 threads hold the row) into m_new,
// then P in place and its row sum into sum, in one fixed order (the same bits whichever order runs them). Macros, not
// functions: as inline functions they changed ptxas's schedule of the shipped builds (cuobjdump), and that schedule
// is the one timed. The maximum reads the kernel's BUG (NO_RUNNING_MAX: 0).
#define FLASH_SM90_ROW_HALF_MAX(s, h, m_run_h, sc, m_new)                                                      \
  float mx = kdtr::neg_inf();                                                                          \
  _Pragma("unroll") for (int j = 0; j < 4; j += 2) mx =                                                \
      fmaxf(mx, fmaxf(fmaxf(s[4 * j + 2 * h], s[4 * j + 2 * h + 1]), fmaxf(s[4 * j + 4 + 2 * h], s[4 * j + 5 + 2 * h]))); \
  const float m_new = BUG == KDTR_BUG_NO_RUNNING_MAX ? 0.f : fmaxf(m_run_h, kdtr::warp_max<4>(mx * sc))
#define FLASH_SM90_ROW_HALF_P(s, h, sc, m_use, sum)                                                           \
  float sum = 0.f;                                                                                     \
  _Pragma("unroll") for (int j = 0; j < 4; j += 2) {                                                   \
    float q[4];                                                                                        \
    _Pragma("unroll") for (int k = 0; k < 4; ++k) {                                                    \
      const int e = 4 * (j + (k >> 1)) + 2 * h + (k & 1);                                              \
      q[k] = s[e] = ex2(fmaf(s[e], sc, -m_use));                                                       \
    }                                                                                                  \
    sum += (q[0] + q[1]) + (q[2] + q[3]);                                                              \
  }

// cp.async.wait_group 0 once `v` has arrived: a plain wait after the Q loads was scheduled by ptxas
// above most of them (global loads and the async copies' shared stores do not alias), which cost the
// producer a round trip.
__device__ __forceinline__ void cp_async_wait_all_after(unsigned v) {
  asm volatile("cp.async.wait_group 0;\n" ::"r"(v) : "memory");
}

__device__ __forceinline__ void st_shared_u32(unsigned addr, unsigned v) {
  asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(addr), "r"(v) : "memory");
}

// The 4 lanes of a quad (lane tq) hold a 4 x 4 block e[c] = M[tq][c]; afterwards e[s] = M[s][tq]. Two
// butterfly stages (partner tq ^ 1, then tq ^ 2), each lane sending two of its four words per stage.
__device__ __forceinline__ void quad_transpose(unsigned (&e)[4], int tq) {
#pragma unroll
  for (int k = 1; k <= 2; k <<= 1) {
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      if (c & k) continue;
      const bool hi = tq & k;
      const unsigned got = __shfl_xor_sync(0xffffffffu, hi ? e[c] : e[c | k], k);
      if (hi) e[c] = got;
      else e[c | k] = got;
    }
  }
}

// Q's latent columns as the producer's wgmma A fragments: rows row (h = 0) and row + 8 (h = 1), a row past
// R reading row R - 1 (masked later). Thread (g, tq) needs 4-byte word tq of every 16-byte chunk c of its
// rows: qf[c / 2][2 (c % 2) + h]. Lane tq of a quad loads chunks 4 m + tq whole and the quad transposes
// each 4 x 4 block: a quarter of the load instructions (and L1 wavefronts) of one 4-byte load per word,
// which made Q's load ~3 200 cycles of a CTA's prologue. The two rows' loads
// interleave (row-by-row order spilled in the planted no-rope variants). T, H: the q row a planted bug reads.
template <int BUG>
__device__ __forceinline__ void load_q_fragments(unsigned (&qf)[QREG_KSTEPS][4], const __nv_bfloat16* qb, int row, int R,
                                                 int tq, int T, int H) {
  static_assert(QREG_KSTEPS % 2 == 0 && QREG_KSTEPS * 16 + QSMEM_SLABS * 64 == KDTR_DK,
                "2 k-steps = 4 chunks of 16 bytes = one block of 4 per quad; the rest of the row in the Q slabs");
  const uint4* src[2] = {reinterpret_cast<const uint4*>(qb + (long long)kdtr::planted_q_row<BUG>(min(row, R - 1), T, H) * KDTR_DK),
                         reinterpret_cast<const uint4*>(qb + (long long)kdtr::planted_q_row<BUG>(min(row + 8, R - 1), T, H) * KDTR_DK)};
#pragma unroll
  for (int m = 0; m < QREG_KSTEPS / 2; ++m) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint4 v = src[h][4 * m + tq];
      unsigned e[4] = {v.x, v.y, v.z, v.w};
      quad_transpose(e, tq);
#pragma unroll
      for (int s = 0; s < 4; ++s) qf[(4 * m + s) >> 1][(((4 * m + s) & 1) << 1) | h] = e[s];
    }
  }
}

// Q_HEAD_MAJOR's Q_x (n_extra rows from xrow0), from rows h * T + t, over the producer's first copy once it and Q's
// fragments are in (copied beside them it cost the ROWS_EXTRA build a spill); one more cp.async group.
template <int BUG>
__device__ __forceinline__ void copy_qx_head_major(unsigned qx, const __nv_bfloat16* qb, int n_extra, int xrow0, int R, int T,
                                                   int H, int wtid) {
  for (int idx = wtid; idx < XR_MAX * SLABS * 8; idx += 128) {
    const int n = idx / (SLABS * 8), sl = (idx >> 3) % SLABS, j = idx & 7;
    if (n < n_extra)
      kdtr::cp_async16(qx + sl * 1024 + n * 128 + ((j ^ (n & 7)) * 16),
                       qb + (long long)kdtr::planted_q_row<BUG>(min(xrow0 + n, R - 1), T, H) * KDTR_DK + sl * 64 + j * 8, true);
  }
  kdtr::cp_async_commit();
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

// D[64 x 256] (+)= A[64 x 16] (shared, K-major descriptor) * B[16 x 256] (shared descriptor, MN-major).
__device__ __forceinline__ void wgmma_ss_m64n256k16(float (&d)[128], unsigned long long desc_a, unsigned long long desc_b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
      "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
      "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"
      "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63,"
      "%64,%65,%66,%67,%68,%69,%70,%71,%72,%73,%74,%75,%76,%77,%78,%79,"
      "%80,%81,%82,%83,%84,%85,%86,%87,%88,%89,%90,%91,%92,%93,%94,%95,"
      "%96,%97,%98,%99,%100,%101,%102,%103,%104,%105,%106,%107,%108,%109,%110,%111,"
      "%112,%113,%114,%115,%116,%117,%118,%119,%120,%121,%122,%123,%124,%125,%126,%127}, "
      "%128, %129, p, 1, 1, 0, 1;\n}\n"
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
      : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

// D[64 x 32] (+)= A[64 x 16] (shared, K-major descriptor) * B[16 x 32] (shared, K-major descriptor).
__device__ __forceinline__ void wgmma_ss_m64n32k16(float (&d)[16], unsigned long long desc_a, unsigned long long desc_b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, "
      "%16, %17, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "l"(desc_a), "l"(desc_b), "r"(accumulate));
}

// D[64 x 8] (+)= A[64 x 16] (shared; K-major descriptor, or MN-major with TRANS_A: M contiguous) * B[16 x 8]
// (shared, K-major descriptor).
template <int TRANS_A = 0>
__device__ __forceinline__ void wgmma_ss_m64n8k16(float (&d)[4], unsigned long long desc_a, unsigned long long desc_b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %6, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 "
      "{%0,%1,%2,%3}, %4, %5, p, 1, 1, %7, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "l"(desc_a), "l"(desc_b), "r"(accumulate), "n"(TRANS_A));
}

// Reductions over the 8 lanes of a warp that share tq (lanes tq, tq + 4, ..., tq + 28): a column of a
// wgmma accumulator's 8-row group.
__device__ __forceinline__ float max_over_g(float x) {
#pragma unroll
  for (int off = 4; off < 32; off <<= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, off));
  return x;
}
__device__ __forceinline__ float sum_over_g(float x) {
#pragma unroll
  for (int off = 4; off < 32; off <<= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

// P_x's four core matrices (the B fragments of both k-steps of O^T) by ldmatrix.
__device__ __forceinline__ void ld_px_fragments(unsigned (&r)[4], unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr) : "memory");
}

__device__ __forceinline__ void st_shared_u16(unsigned addr, unsigned short v) {  // P_x's stores only
  asm volatile("st.shared.u16 [%0], %1;\n" ::"r"(addr), "h"(v) : "memory");
}

}  // namespace flash_sm90

// The live tail tiles of rows [r0, r_end) of a request: mask word w (nodes 32 w .. 32 w + 31) that some
// of its rows see. N threads (t = 0 .. N - 1, `sync` their barrier) scan the words; thread `leader`
// lists them in `tiles`; every caller gets n_pre + their count.
template <int N, int BUG, typename Sync>
__device__ __forceinline__ int find_tail_tiles(const KdtrParams& p, int b, const unsigned* mask_b, int r0, int r_end, int H, int W, bool has_tail,
                                               int n_pre, int t, bool leader, int* live, unsigned char* tiles,
                                               int* n_tail_s, Sync sync) {
  if (t < flash_sm90::MAX_TAIL_TILES) live[t] = 0;
  sync();
  if (has_tail)
    kdtr::for_each_tail_word<N, BUG>(p, b, mask_b, r0, r_end, H, W, t, [&](unsigned word, int w) {
      if (word) live[w] = 1;
    });
  sync();
  if (leader) {
    int n = 0;
    for (int w = 0; w < W && w < flash_sm90::MAX_TAIL_TILES; ++w)
      if (live[w]) tiles[n++] = w;
    *n_tail_s = has_tail ? n : 0;
  }
  sync();
  return n_pre + *n_tail_s;
}
