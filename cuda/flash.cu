// flash.cu -- the fast kernel: bf16 tensor-core tree-verify MLA attention (SPEC sections 1, 3, 5).
//
// What is in it
//   kdtr_flash_verify<MT, OutT, BUG>   one CTA = one row tile (16*MT query rows of one request,
//                                      rows r = node*H + head) x one KV split of that request.
//   kdtr_flash_combine<OutT>           merges the splits' partial (out, lse) by their LSE; _rows<OutT, PARTS>
//                                      does it a warp per row (or half row) where rows are many,
//                                      _narrow<OutT, COLS, WARPS> in 32- or 64-column chunks where they are
//                                      few (flash_split.cuh).
//
// Design (numbers for the 64-row tile, MT = 4: 8 warps, 256 threads)
//   * One latent KV stream per request (MQA): every row of the tile reads the same KV tile from
//     shared memory; a tile is fetched once per CTA whatever the head count.
//   * KV tiles of BN keys x 576 (32 on the 64-row tile, 16 on the 16- and 32-row ones, so that sm_120
//     holds two of those CTAs an SM) come in through cp.async, STAGES = 2 deep (37.4 / 18.7 KB a
//     stage, rows padded to 1168 B so ldmatrix is bank-conflict free); each thread copies chunks of
//     one key row, so the block table is read once per thread and tile.
//   * S = Q K^T with mma.sync m16n8k16 (bf16 in, fp32 accumulate). Q stays in registers for the
//     whole kernel: warp (rg, kg) holds rows rg*16..+16 over columns kg*288..+288 (KG = 2 k-groups;
//     4 for the 16-row tile) and produces a partial S over BN / 8 independent n-tile chains; the
//     partials are summed in shared memory.
//   * Online softmax in fp32 (exp2 domain), 4 or 8 threads per row, once per BN keys; P rounded to bf16 for P V;
//     the row sum uses the fp32 P. The 64-row tile keeps the running (l, m) in shared memory (in
//     registers it spills). Tail tiles only: a thread reads its keys' mask word once (64-row tile) or
//     once a key (16-key tiles: faster there).
//   * O = P V: warp w owns output columns w*64..+64 of all 64 rows (128 fp32 accumulators); V is
//     the same shared tile read through ldmatrix.trans. O's rescale is skipped on a tile where no row
//     took a new max (a warp vote over the row factors: every factor is then 1, the bits the same).
//   * Tree tail in the same pass: only tail tiles that some row of the tile sees are loaded (a
//     live-tile list built from the mask words at the start); mask bits decide visibility.
//   * Split-KV: the prefix of each request is cut into equal ranges (BN-key aligned), as many as its
//     entry in the plan's split table says (flash_sched.cuh: looked up on the device from its prefix
//     length, so a CUDA graph captured at other lengths stays right; the grid holds the capacity's
//     count and the CTAs past a request's exit); the last split also takes the tail. With one split
//     the kernel writes out/lse directly, else kdtr_flash_combine merges the fp32 partials by their LSE.
//   Shared memory: 42.7 / 43.6 / 98.0 KB for the 16 / 32 / 64-row tiles (static_assert: <= 99 KB,
//   sm_120's limit); above 48 KB, so the launcher raises the dynamic-shared-memory limit.
//
// How to run
//   kdtr verify -k flash ci          correctness on the committed goldens (needs a GPU)
//   kdtr bench  -k flash --model deepseek-v3 --tp 8 --budget 64,256 --prefix 8k,32k
//   The launch geometry (MT, splits, workspace) is chosen in kdtr/kernels/flash/plan.py from the shape.

#include <cuda_bf16.h>

#include "kdtr_abi.h"
#include "kdtr_common.cuh"
// the combine launch's partial rows in flight per warp (flash_split.cuh): 8 (at 9 the sm_120 build spills)
namespace kdtr {
constexpr int COMBINE_BATCH = 8;
}
#include "flash_split.cuh"

// ---------------------------------------------------------------------------------------------
// constants
// ---------------------------------------------------------------------------------------------
namespace flash {

constexpr int KSTEPS = KDTR_DK / 16;            // 36 mma k-steps over 576
constexpr int LATENT_KSTEPS = KDTR_DV / 16;     // 32: k-steps >= this are the RoPE columns
constexpr int ROW_BYTES = KDTR_DK * 2 + 16;     // 1168: padded smem row of one key
constexpr int CHUNKS = KDTR_DK * 2 / 16;        // 72 16-byte chunks per key row
constexpr int STAGES = 2;                       // cp.async pipeline depth (two CTAs an SM on sm_120 below 64 rows)
constexpr int MAX_T = 1280;                     // tree nodes supported (tail-tile list size)
using kdtr::LOG2E;
using kdtr::LN2;
using kdtr::store2;

// Warps splitting the 576-wide Q K^T of one m-tile: 4 for the 16-row tile (4 warps in all),
// 2 for 32 and 64 rows (4 and 8 warps). Each warp then holds 36 * 4 / KG Q registers and a
// 16*MT x 512/(MT*KG) slice of O: 64 or 128 fp32 accumulators.
template <int MT>
struct Tile {
  static constexpr int BM = 16 * MT;                 // query rows per CTA
  static constexpr int BN = MT == 4 ? 32 : 16;       // keys per KV tile
  static constexpr int STAGE_BYTES = BN * ROW_BYTES; // 37 376 or 18 688
  static constexpr int PS_STRIDE = BN + 8;           // bf16 per row of P in smem (80 or 48 B: conflict free)
  static constexpr int MAX_TAIL_TILES = MAX_T / BN;  // 40 or 80
  static constexpr int LIVE_WORDS = MAX_TAIL_TILES / 32 + 1;
  static constexpr int KG = MT == 1 ? 4 : 2;         // k-groups
  static constexpr int KSTEPS_G = KSTEPS / KG;       // k-steps per k-group (9 or 18)
  static constexpr int NWARPS = MT * KG;
  static constexpr int NTHREADS = 32 * NWARPS;
  static constexpr int NT_O = 64 / NWARPS;           // output n-tiles (8 columns) per warp
  static constexpr int TPR = NTHREADS / BM;          // softmax threads per row (8 or 4)
  static constexpr int EPT = BN / TPR;               // softmax keys per thread (2 or 4)
  static constexpr int SCH = MT == 1 ? 2 : 1;        // S accumulator chains a n-tile (registers allow 2 only at 16 rows)
  static constexpr bool RUN_SMEM = MT == 4;          // running (l, m) in shared memory: the 64-row tile spills with them in registers
};

template <int MT>
struct Smem {                                   // byte offsets into dynamic shared memory
  using TL = Tile<MT>;
  static constexpr int BM = TL::BM, BN = TL::BN;
  static constexpr int kv = 0;                                  // [STAGES][BN][ROW_BYTES]
  static constexpr int spart = kv + STAGES * TL::STAGE_BYTES;   // float [KG][BM][BN]
  static constexpr int ps = spart + TL::KG * BM * BN * 4;       // bf16  [BM][PS_STRIDE]
  static constexpr int rowf = ps + BM * TL::PS_STRIDE * 2;      // float [2][BM] alpha | l, m
  static constexpr int run = rowf + 2 * BM * 4;                 // float [2][2][BM] running (l, m) by tile parity (RUN_SMEM)
  static constexpr int tiles = run + (TL::RUN_SMEM ? 4 * BM * 4 : 0);  // int [MAX_TAIL_TILES]
  static constexpr int live = tiles + TL::MAX_TAIL_TILES * 4;   // unsigned [LIVE_WORDS]
  static constexpr int count = live + TL::LIVE_WORDS * 4;       // int
  static constexpr int bytes = count + 16;
};

static_assert(Smem<1>::bytes <= 99 * 1024 && Smem<2>::bytes <= 99 * 1024 && Smem<4>::bytes <= 99 * 1024,
              "shared memory per block must stay within sm_120's 99 KB");

}  // namespace flash

// Read by kdtr/kernels/flash/kernel.py (module.get_global) so the launcher never restates these numbers.
extern "C" __constant__ int kdtr_flash_config[16] = {
    flash::Tile<1>::BN, flash::Tile<2>::BN, flash::Tile<4>::BN, flash::STAGES, flash::MAX_T,
    flash::Smem<1>::bytes, flash::Smem<2>::bytes, flash::Smem<4>::bytes,
    flash::Tile<1>::NTHREADS, flash::Tile<2>::NTHREADS, flash::Tile<4>::NTHREADS, 32 * COMBINE_WARPS, COMBINE_MAX_CHUNKS,
    COMBINE_ROWS_MAX_SPLITS, NARROW_BATCH, COMBINE_ROWS_BATCH};

// ---------------------------------------------------------------------------------------------
// device helpers (PTX wrappers)
// ---------------------------------------------------------------------------------------------
namespace flash {

using kdtr::cp_async16;
using kdtr::cp_async_commit;
using kdtr::cp_async_wait;
using kdtr::ld_u32;
using kdtr::ldsm_x4;
using kdtr::ldsm_x4_trans;
using kdtr::mma_bf16;
using kdtr::smem_addr;


}  // namespace flash

// ---------------------------------------------------------------------------------------------
// kernels
// ---------------------------------------------------------------------------------------------
template <int MT, typename OutT, int BUG>
__global__ void __launch_bounds__(flash::Tile<MT>::NTHREADS, 1) kdtr_flash_verify(const KdtrParams p, const FlashSched sched) {
  using namespace flash;
  using S = Smem<MT>;
  using TL = Tile<MT>;
  constexpr int BM = TL::BM, KG = TL::KG, KSTEPS_G = TL::KSTEPS_G, NTHREADS = TL::NTHREADS;
  constexpr int NT_O = TL::NT_O, TPR = TL::TPR, EPT = TL::EPT, SCH = TL::SCH;
  constexpr int BN = TL::BN, STAGE_BYTES = TL::STAGE_BYTES, PS_STRIDE = TL::PS_STRIDE;
  constexpr int MAX_TAIL_TILES = TL::MAX_TAIL_TILES, LIVE_WORDS = TL::LIVE_WORDS;
  static_assert(BN == 16 || BN == 32, "the live-tile marks read a mask word as two tiles or one");
  constexpr int COLS_W = NT_O * 8;     // output columns per warp

  extern __shared__ __align__(16) unsigned char smem[];
  kdtr::pdl_launch_dependents();  // the combine launch may take SMs as they free up; it waits for this grid
  float* spart = reinterpret_cast<float*>(smem + S::spart);
  __nv_bfloat16* ps = reinterpret_cast<__nv_bfloat16*>(smem + S::ps);
  float* rowf = reinterpret_cast<float*>(smem + S::rowf);
  float* run = reinterpret_cast<float*>(smem + S::run);  // tile i reads parity i & 1, writes the other
  int* tail_tiles = reinterpret_cast<int*>(smem + S::tiles);
  unsigned* live = reinterpret_cast<unsigned*>(smem + S::live);
  int* n_tail_s = reinterpret_cast<int*>(smem + S::count);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, tq = lane & 3;
  const int b = blockIdx.z, split = blockIdx.y, stride = p.num_splits;  // stride: the workspace's splits
  const int H = p.H, T = p.T, R = T * H, W = p.mask_words;
  const int r0 = blockIdx.x * BM;
  const int P = p.prefix_lens[b];
  const int nsplit = kdtr::request_splits(sched, P);  // this request's splits, from its length (graph-safe)
  if (split >= nsplit) return;  // a grid for the capacity: a shorter request needs fewer
  const __nv_bfloat16* kv = static_cast<const __nv_bfloat16*>(p.kv_cache);
  const unsigned* mask_b = p.tree_mask + (long long)(BUG == KDTR_BUG_MASK_REQUEST0 ? 0 : b) * T * W;

  // ---- this CTA's keys: prefix range [kp_lo, kp_hi) of its split, plus the tail if last ----
  const kdtr::SplitKeys keys = kdtr::split_keys<BN, BUG>(P, T, split, nsplit);
  const int kp_lo = keys.lo, kp_hi = keys.hi, n_pre = keys.n_pre;
  const bool has_tail = keys.has_tail;

  // ---- live tail tiles: a BN-node tile some row of this tile sees (rows only see c <= t) ----
  if (tid < LIVE_WORDS) live[tid] = 0;
  __syncthreads();
  if (has_tail)
    kdtr::for_each_tail_word<NTHREADS, BUG>(p, b, mask_b, r0, min(R, r0 + BM), H, W, tid, [&](unsigned word, int w) {
      if constexpr (BN == 32) {  // mask word w is tail tile w
        if (word) atomicOr(&live[w >> 5], 1u << (w & 31));
      } else {  // its halves are tail tiles 2w and 2w + 1
        if (word & 0xFFFFu) atomicOr(&live[(2 * w) >> 5], 1u << ((2 * w) & 31));
        if (word >> 16) atomicOr(&live[(2 * w + 1) >> 5], 1u << ((2 * w + 1) & 31));
      }
    });
  __syncthreads();
  if (tid == 0) {
    int n = 0;
    if (has_tail)
      for (int i = 0; i * BN < T && i < MAX_TAIL_TILES; ++i)
        if ((live[i >> 5] >> (i & 31)) & 1u) tail_tiles[n++] = i * BN;
    *n_tail_s = n;
  }
  __syncthreads();
  const int n_tiles = n_pre + *n_tail_s;
  // first key of tile i: prefix tiles from kp_lo, tail tiles at P + (BN-aligned node index)
  auto tile_key0 = [&](int i) { return i < n_pre ? kp_lo + i * BN : P + tail_tiles[i - n_pre]; };

  // Each thread copies chunks of one key row (TPK threads per key), so the block table is read
  // once per thread and tile, not once per 16-byte chunk; a tile's block-table entry is loaded one
  // tile before its copy is issued and first used there, so the load's latency hides behind a tile's
  // products (the loop carries the entry as loaded, not the address made from it).
  constexpr int TPK = NTHREADS / BN;
  struct KvRef { int page, row; };  // a block-table entry and the row in its page; row -1: zero-filled
  auto tile_ref = [&](int i) -> KvRef {  // this thread's key row of tile i
    if (i >= n_tiles) return {0, -1};
    const int j = tile_key0(i) + tid / TPK;
    if (j >= (i < n_pre ? kp_hi : P + T)) return {0, -1};  // keys past the range are zero-filled
    const int jt = kdtr::planted_token<BUG>(j, P);  // j but for planted bugs
    const int page_index = min((BUG == KDTR_BUG_PAGE_OFF_BY_ONE ? jt + 1 : jt) / p.page_size, p.max_pages - 1);
    const int page = p.block_table[BUG == KDTR_BUG_BLOCK_TABLE_STRIDE ? kdtr::block_table_row<BUG>(p, b, P) + page_index
                                                                      : (long long)b * p.max_pages + page_index];
    return {page, jt % p.page_size};
  };
  auto load_tile = [&](KvRef r, int stage) {
    const bool ok = r.row >= 0;
    const __nv_bfloat16* src = ok ? kv + kdtr::kv_page_row(p, r.page, r.row) : kv;
    const unsigned dst = smem_addr(smem + S::kv + stage * STAGE_BYTES + (tid / TPK) * ROW_BYTES);
    for (int ch = tid % TPK; ch < CHUNKS; ch += TPK) cp_async16(dst + ch * 16, src + ch * 8, ok);
  };

  // ---- Q fragments in registers: rows rg*16.., k-steps kg*9.. ----
  const int rg = warp % MT, kg = warp / MT;
  unsigned qf[KSTEPS_G][4];
  {
    const __nv_bfloat16* qb = static_cast<const __nv_bfloat16*>(p.q) + (long long)b * R * KDTR_DK;
    const int ra = r0 + rg * 16 + g, rb = ra + 8;
    const int qa = kdtr::planted_q_row<BUG>(ra, T, H), qb8 = kdtr::planted_q_row<BUG>(rb, T, H);  // q rows read
#pragma unroll
    for (int ks = 0; ks < KSTEPS_G; ++ks) {
      const int k = (kg * KSTEPS_G + ks) * 16 + 2 * tq;
      // the planted NO_ROPE bug zeroes Q's RoPE columns, so S is taken over the 512 latent ones
      const bool rope_off = BUG == KDTR_BUG_NO_ROPE && kg * KSTEPS_G + ks >= LATENT_KSTEPS;
      qf[ks][0] = ra < R && !rope_off ? ld_u32(qb + (long long)qa * KDTR_DK + k) : 0u;
      qf[ks][1] = rb < R && !rope_off ? ld_u32(qb + (long long)qb8 * KDTR_DK + k) : 0u;
      qf[ks][2] = ra < R && !rope_off ? ld_u32(qb + (long long)qa * KDTR_DK + k + 8) : 0u;
      qf[ks][3] = rb < R && !rope_off ? ld_u32(qb + (long long)qb8 * KDTR_DK + k + 8) : 0u;
    }
  }

  // ---- softmax ownership: row sr, keys sk .. sk+EPT-1 (TPR threads per row) ----
  const int sr = tid / TPR, sk = (tid % TPR) * EPT;
  const int srow = r0 + sr;
  const bool row_ok = srow < R;
  const int st = row_ok ? srow / H : 0;  // tree node of this row
  // this row's mask words in p.tree_mask, an int (one register, where a pointer takes two: the 64-row
  // tile spills without it; a mask has far fewer than 2^31 words)
  const int mrow = ((BUG == KDTR_BUG_MASK_REQUEST0 ? 0 : b) * T + st) * W;
  auto mask_word = [&](int w) {  // word w of this row's mask as the kernel reads it (planted bugs)
    return kdtr::MASK_ADDRESS_BUG<BUG> ? kdtr::tree_mask_word<BUG>(p, b, st, w) : kdtr::planted_mask_word<BUG>(p.tree_mask[mrow + w], st, w);
  };
  const float sc = p.scale * kdtr::PLANTED_LOG2E<BUG> * (BUG == KDTR_BUG_SCALE_OFF ? 1.01f : 1.0f);
  float m_reg = kdtr::neg_inf(), l_reg = 0.f;  // the running (l, m), in registers unless RUN_SMEM
  if (TL::RUN_SMEM && tid % TPR == 0) {
    run[sr] = 0.f;
    run[BM + sr] = kdtr::neg_inf();
  }

  float acc[MT][NT_O][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT_O; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mt][nt][e] = 0.f;

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < n_tiles) load_tile(tile_ref(s), s);
    cp_async_commit();
  }
  KvRef next_ref = tile_ref(STAGES - 1);  // at iteration i: tile i + STAGES - 1's

  for (int i = 0; i < n_tiles; ++i) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();  // [A] tile i resident; everyone is done with tile i-1 and its P
    {
      const int nx = i + STAGES - 1;
      if (nx < n_tiles) load_tile(next_ref, nx % STAGES);
      cp_async_commit();
      next_ref = tile_ref(nx + 1);
    }
    const unsigned char* stile = smem + S::kv + (i % STAGES) * STAGE_BYTES;

    // S partial = Q[rows, kg cols] K[keys, kg cols]^T, over NS n-tiles x SCH independent accumulator
    // chains (the mma latency, not its issue rate, bounds one chain)
    constexpr int NS = BN / 8;
    float sacc[SCH][NS][4];
#pragma unroll
    for (int c = 0; c < SCH; ++c)
#pragma unroll
      for (int n = 0; n < NS; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) sacc[c][n][e] = 0.f;
    {
      const int key = (lane & 7) + ((lane >> 4) << 3);
      const int coff = ((lane >> 3) & 1) * 8;
#pragma unroll
      for (int ks = 0; ks < KSTEPS_G; ++ks) {
        const int kstep = kg * KSTEPS_G + ks;
#pragma unroll
        for (int kh = 0; kh < BN / 16; ++kh) {  // 16 keys a K fragment
          unsigned kb[4];
          ldsm_x4(kb, smem_addr(stile + (kh * 16 + key) * ROW_BYTES + (kstep * 16 + coff) * 2));
          mma_bf16(sacc[ks % SCH][2 * kh], qf[ks], kb[0], kb[1]);
          mma_bf16(sacc[ks % SCH][2 * kh + 1], qf[ks], kb[2], kb[3]);
        }
      }
#pragma unroll
      for (int c = 1; c < SCH; ++c)
#pragma unroll
        for (int n = 0; n < NS; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) sacc[0][n][e] += sacc[c][n][e];
      float* sp = spart + (kg * BM + rg * 16) * BN;
#pragma unroll
      for (int nt = 0; nt < NS; ++nt) {
        *reinterpret_cast<float2*>(sp + g * BN + nt * 8 + 2 * tq) = make_float2(sacc[0][nt][0], sacc[0][nt][1]);
        *reinterpret_cast<float2*>(sp + (g + 8) * BN + nt * 8 + 2 * tq) = make_float2(sacc[0][nt][2], sacc[0][nt][3]);
      }
    }
    __syncthreads();  // [B] partial scores complete

    // online softmax of row sr over keys sk .. sk+EPT-1
    {
      float sv[EPT];
#pragma unroll
      for (int e = 0; e < EPT; ++e) sv[e] = 0.f;
#pragma unroll
      for (int k = 0; k < KG; ++k)
#pragma unroll
        for (int e = 0; e < EPT; ++e) sv[e] += spart[(k * BM + sr) * BN + sk + e];
      const int key0 = tile_key0(i);
      float mx = kdtr::neg_inf();
      if (i < n_pre) {  // prefix tile: every key of the range
#pragma unroll
        for (int e = 0; e < EPT; ++e) {
          sv[e] = (key0 + sk + e < kp_hi && row_ok) ? sv[e] * sc : kdtr::neg_inf();
          mx = fmaxf(mx, sv[e]);
        }
      } else {  // tail tile: keys sk .. sk+EPT-1 lie in one mask word (the tile is BN-aligned); the 64-row tile
                // reads it once a thread (once a key spills), 16-key tiles once a key (3-5 % faster there)
        const int c0 = key0 - P + sk;
        const unsigned word = BN == 32 ? mask_word(c0 >> 5) : 0u;
#pragma unroll
        for (int e = 0; e < EPT; ++e) {
          const int c = c0 + e;
          const bool vis = c < T && (((BN == 32 ? word : mask_word(c >> 5)) >> (c & 31)) & 1u);  // SIBLING_VISIBLE: in the word
          sv[e] = (vis && row_ok) ? sv[e] * sc : kdtr::neg_inf();
          mx = fmaxf(mx, sv[e]);
        }
      }
      const float* rin = run + (i & 1) * 2 * BM;
      float* rout = run + ((i + 1) & 1) * 2 * BM;
      const float m_run = TL::RUN_SMEM ? rin[BM + sr] : m_reg, l_run = TL::RUN_SMEM ? rin[sr] : l_reg;
      const float m_new = BUG == KDTR_BUG_NO_RUNNING_MAX ? 0.f : fmaxf(m_run, kdtr::warp_max<TPR>(mx));
      const float m_use = m_new == kdtr::neg_inf() ? 0.f : m_new;
      const float alpha = exp2f(m_run - m_use);
      float psum = 0.f;
#pragma unroll
      for (int e = 0; e < EPT; ++e) {
        sv[e] = exp2f(sv[e] - m_use);
        psum += sv[e];
      }
      const float l_new = l_run * alpha + kdtr::warp_sum<TPR>(psum);
      if constexpr (TL::RUN_SMEM) {
        if (tid % TPR == 0) {
          rout[sr] = l_new;
          rout[BM + sr] = m_new;
        }
      } else {
        l_reg = l_new;
        m_reg = m_new;
      }
#pragma unroll
      for (int e = 0; e < EPT; e += 2)
        *reinterpret_cast<__nv_bfloat162*>(ps + sr * PS_STRIDE + sk + e) = __floats2bfloat162_rn(sv[e], sv[e + 1]);
      // a row that held nothing (m_run = -inf) has O = 0, which any factor leaves: 1, so that O's rescale below
      // is skipped on tiles where no row's max moved (not 0, which an underflowed factor also gives)
      if (tid % TPR == 0) rowf[sr] = m_run == kdtr::neg_inf() ? 1.f : alpha;
    }
    __syncthreads();  // [C] P and alpha ready

    // O[:, cols of this warp] = alpha * O + P V
    {
      const int cb = warp * COLS_W;
      // m-tiles in groups of MG: P fragments of a group stay in registers while V is walked, 16 keys
      // (one k-step) at a time (MG = 2 keeps the 64-row variant within its registers; V is then read twice).
      constexpr int MG = MT < 2 ? MT : 2;
      const int vkey = (lane & 7) + ((lane >> 3) & 1) * 8;
      auto load_p = [&](unsigned (&pa)[MG][4], int m0, int kh) {
#pragma unroll
        for (int mg = 0; mg < MG; ++mg)
          ldsm_x4(pa[mg], smem_addr(ps + ((m0 + mg) * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * PS_STRIDE +
                                    kh * 16 + (lane >> 4) * 8));
      };
      auto load_v = [&](unsigned (&vb)[4], int kh, int nt) {
        ldsm_x4_trans(vb, smem_addr(stile + (kh * 16 + vkey) * ROW_BYTES +
                                    (kdtr::V_COL0<BUG> + cb + (nt + (lane >> 4)) * 8) * 2));
      };
      bool rescale = false;
#pragma unroll
      for (int m0 = 0; m0 < MT; m0 += MG) {
        // the group's first P fragments are asked for before the rescale, whose FMULs then fill their latency
        unsigned pa[MG][4];
        load_p(pa, m0, 0);
        if (m0 == 0) {  // some row of the tile took a new max (each warp reads every row's factor)
          bool moved = false;
#pragma unroll
          for (int r = lane; r < BM; r += 32) moved |= rowf[r] != 1.f;
          rescale = __any_sync(0xffffffffu, moved);  // else every factor is 1: O as it is (the same bits)
        }
        if (rescale) {  // O's rows of this group, just before their P V
#pragma unroll
          for (int mt = m0; mt < m0 + MG; ++mt) {
            const float a0 = rowf[mt * 16 + g], a1 = rowf[mt * 16 + g + 8];
#pragma unroll
            for (int nt = 0; nt < NT_O; ++nt) {
              acc[mt][nt][0] *= a0;
              acc[mt][nt][1] *= a0;
              acc[mt][nt][2] *= a1;
              acc[mt][nt][3] *= a1;
            }
          }
        }
#pragma unroll
        for (int kh = 0; kh < BN / 16; ++kh) {
          if (kh > 0) load_p(pa, m0, kh);
#pragma unroll
          for (int nt = 0; nt < NT_O; nt += 2) {
            unsigned vb[4];
            load_v(vb, kh, nt);
#pragma unroll
            for (int mg = 0; mg < MG; ++mg) {
              mma_bf16(acc[m0 + mg][nt], pa[mg], vb[0], vb[1]);
              mma_bf16(acc[m0 + mg][nt + 1], pa[mg], vb[2], vb[3]);
            }
          }
        }
      }
    }
  }
  cp_async_wait<0>();

  // ---- epilogue: final (l, m) per row to smem, then out (one split) or partials (several) ----
  __syncthreads();
  if (tid % TPR == 0) {
    rowf[sr] = TL::RUN_SMEM ? run[(n_tiles & 1) * 2 * BM + sr] : l_reg;
    rowf[BM + sr] = TL::RUN_SMEM ? run[(n_tiles & 1) * 2 * BM + BM + sr] : m_reg;
  }
  __syncthreads();
  const bool direct = nsplit == 1;
  float* ws_o = static_cast<float*>(p.workspace);
  float* ws_lse = ws_o + (long long)p.B * stride * R * KDTR_DV;
  const int cb = warp * COLS_W;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int rl = mt * 16 + g + half * 8, r = r0 + rl;
      if (r >= R) continue;
      const float l = rowf[rl], m = rowf[BM + rl];
      const float inv = l > 0.f ? 1.f / l : 0.f;
      const long long orow = direct ? ((long long)b * R + r) * KDTR_DV
                                    : (((long long)b * stride + split) * R + r) * KDTR_DV;
#pragma unroll
      for (int nt = 0; nt < NT_O; ++nt) {
        const int col = cb + nt * 8 + 2 * tq;
        const float o0 = kdtr::planted_store<BUG, OutT>(acc[mt][nt][2 * half] * inv),
                    o1 = kdtr::planted_store<BUG, OutT>(acc[mt][nt][2 * half + 1] * inv);
        if (direct) store2<OutT>(static_cast<OutT*>(p.out) + orow + col, o0, o1);
        else store2<float>(static_cast<float*>(p.workspace) + orow + col, o0, o1);
      }
      if (warp == 0 && tq == 0) {
        // lse in natural log; the planted merge bug drops the max from the partials' lse
        const float lse2 = BUG == KDTR_BUG_MERGE_WRONG_MAX && !direct ? log2f(l) : m + log2f(l);
        const float lse = l > 0.f ? lse2 * kdtr::PLANTED_LN2<BUG> : kdtr::neg_inf();
        if (direct) p.lse[(long long)b * R + r] = lse;
        else ws_lse[((long long)b * stride + split) * R + r] = lse;
      }
    }
  }
}
