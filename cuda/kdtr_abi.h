// kdtr_abi.h -- the one argument contract between kdtr and every verify kernel.
//
// Every kernel kdtr launches (the built-in naive and flash kernels, and user kernels given as
// `path/to/file.cu:symbol`) is a __global__ function taking ONE argument, `const KdtrParams p`,
// by value. kdtr/kernels/contract.py mirrors this struct as a numpy structured dtype (same field order, C
// alignment); tests/kernels/test_contract.py parses this file and keeps the two, the dimensions below and the
// KdtrBug list equal to kdtr/inputs/presets.py and kdtr/kernels/bugs.py.
//
// Plain C types only (void*, int, unsigned, float): NVRTC compiles this without system headers.
//
// The operator (SPEC section 1), for request b, tree node t, head h:
//   s_j = scale * dot(q[b, t, h, 0:576], kv[token j of b, 0:576])     j in [0, P_b + T)
//   visible(t, j) = j < P_b  or  bit (j - P_b) of tree_mask[b, t]
//   out[b, t, h, :] = sum_j softmax_visible(s)_j * kv[token j of b, 0:512]
//   lse[b, t, h]    = log(sum_{visible j} exp(s_j))          (natural log)
// Token j of request b lives in cache row
//   kv_cache[block_table[b, j / page_size], j % page_size, :].
// Tree node i of request b is token P_b + i (the draft tail is already in the cache).
//
// ---------------------------------------------------------------------------------------------
// Launch contract for user kernels (`kdtr verify path/to/file.cu:symbol`)
// ---------------------------------------------------------------------------------------------
// * `symbol` is a C++ name expression of a __global__ function taking `const KdtrParams`, e.g.
//   `my_verify` or `my_verify<256>`. The placeholders `{kv}` and `{out}` in it are replaced by
//   `float` / `__nv_bfloat16` for the storage and output dtype of each run, e.g.
//   `file.cu:my_verify<{kv}, {out}>`; without them the same instantiation runs on every dtype.
// * The include path holds kdtr's cuda/ directory and the file's own directory, so a kernel can
//   `#include "kdtr_abi.h"` and `#include "kdtr_common.cuh"`. Compiled by NVRTC with -std=c++17
//   for the device's sm_XY (no --use_fast_math).
// * Geometry: the file may define
//       extern "C" __constant__ int kdtr_launch[4] = {rows_per_block, threads, smem_bytes, num_splits};
//   (default {1, 128, 0, 1}). kdtr launches
//       grid  = (ceil(T * H / rows_per_block), B, num_splits),   block = (threads, 1, 1),
//   with smem_bytes of dynamic shared memory (the opt-in attribute is set above 48 KB). A query
//   "row" is r = t * H + h: the T*H rows of request b are contiguous in q, out and lse.
// * Workspace: when num_splits > 1, p.workspace points at KDTR_WORKSPACE_BYTES(B, T, H, splits)
//   zero-filled bytes (room for fp32 partial out, max and sum per split and row, plus one int
//   counter per row, for a last-block-combines merge); otherwise it is null.
// * Before every launch out is filled with NaN and lse with NaN: every element must be written.
//   The kernel must not read outside a request's tokens [0, P_b + T): unused cache slots hold NaN.
// * Graph safety (what `kdtr verify --graph` checks; SPEC section 8). A server captures the launch in a
//   CUDA graph once, with dummy prefix lengths in the buffers (0, 1 or 1024), then writes each step's real
//   lengths, block table, tree mask, q and cache into the same buffers and replays it. So a kernel must
//   read every length, page and mask bit from the device buffers at run time and decide there anything
//   that depends on them (split counts, work lists), into scratch it owns in p.workspace; it must not
//   depend on values the launch read on the host, allocate, synchronise, or copy to or from the host. The
//   grid comes from kdtr_launch and the shapes alone, which keeps kdtr's own launch of it graph-safe.
// ---------------------------------------------------------------------------------------------

#pragma once

#define KDTR_DK 576    // key / query width: latent 512 + RoPE 64
#define KDTR_DV 512    // value width: columns 0:512 of the same cache rows
#define KDTR_DROPE 64  // RoPE columns (keys only): KDTR_DK - KDTR_DV
#define KDTR_MASK_BITS 32  // tree-mask bits per unsigned word
#define KDTR_BUG_TILE 64   // the KV tile "the last partial prefix tile" refers to (bugs.TILE)

struct KdtrParams {
  const void* q;             // [B, T, H, 576] storage dtype (float or __nv_bfloat16)
  const void* kv_cache;      // [num_pages, page_size, 576] storage dtype; V = columns 0:512
  const int* block_table;    // [B, max_pages] page ids of each request's tokens, in order
  const int* prefix_lens;    // [B] committed prefix length P_b (>= 0)
  const unsigned* tree_mask; // [B, T, mask_words] bit c%32 of word c/32 of row t: t sees node c
  void* out;                 // [B, T, H, 512] out dtype (float or __nv_bfloat16)
  float* lse;                // [B, T, H] natural-log LSE of the visible scores
  void* workspace;           // kernel-defined scratch (split-KV partials), workspace_bytes long
  int B;                     // requests
  int T;                     // tree nodes per request (root + budget), >= 1
  int H;                     // query heads on this GPU
  int page_size;             // tokens per cache page (1 = SGLang token pool, 64 = FlashMLA)
  int max_pages;             // block_table row length
  int mask_words;            // ceil(T / 32)
  int num_pages;             // pages in kv_cache
  int num_splits;            // KV splits of this launch (gridDim.z for user kernels; for the flash kernels the
                             // grid's, the most a request takes: a request's own count is decided on the device)
  float scale;               // softmax scale applied to q.k (the model's, never 576**-0.5)
};

// Workspace for user kernels with num_splits > 1 (see the launch contract above).
#define KDTR_WORKSPACE_BYTES(B, T, H, splits) \
  ((long long)(splits) * (B) * (T) * (H) * (KDTR_DV + 2) * 4 + (long long)(B) * (T) * (H) * 4)

// Planted bugs (kdtr/kernels/bugs.py defines each one; same names and values): kernels take one as the
// compile-time template parameter BUG so that kdtr can prove its checks catch it.
enum KdtrBug {
  KDTR_BUG_NONE = 0,
  KDTR_BUG_SIBLING_VISIBLE = 1,   // row t also sees tail node t-1 when it is not an ancestor
  KDTR_BUG_DROP_PREFIX_KEY = 2,   // prefix key j = P_b - 1 skipped when P_b > 0
  KDTR_BUG_DROP_PARTIAL_TILE = 3, // prefix keys j >= 64 * (P_b / 64) skipped
  KDTR_BUG_SCALE_OFF = 4,         // scale * 1.01 used
  KDTR_BUG_NO_ROPE = 5,           // q.k over the 512 latent columns only
  KDTR_BUG_MERGE_WRONG_MAX = 6,   // split partials merged without rescaling to the common max
  KDTR_BUG_PAGE_OFF_BY_ONE = 7,   // token j read from page block_table[b, (j + 1) / page_size]
  KDTR_BUG_BAKED_LENGTHS = 8,     // the launch's own copy of the prefix lengths it was prepared with (no kernel build)
  KDTR_BUG_MASK_STRIDE = 9,       // mask word (t, w) read at flat word (b * T + t) * (T / 32 + 1) + w (clamped)
  KDTR_BUG_MASK_BIT_ORDER = 10,   // tree node c read from bit 31 - c % 32 of its word
  KDTR_BUG_CAUSAL_MASK = 11,      // node t sees tree nodes 0..t whatever the mask says
  KDTR_BUG_MASK_REQUEST0 = 12,    // every request reads request 0's mask
  KDTR_BUG_NO_SELF = 13,          // node t does not see itself
  KDTR_BUG_Q_HEAD_MAJOR = 14,     // query row (t, h) read from row h * T + t of the request's q
  KDTR_BUG_BLOCK_TABLE_STRIDE = 15,  // request b's block-table row at entry b * ceil((P_b + T) / page_size)
  KDTR_BUG_TAIL_POSITION = 16,    // tree node c's key read at token c, not P_b + c
  KDTR_BUG_NO_RUNNING_MAX = 17,   // p = exp(s): no maximum subtracted
  KDTR_BUG_LSE_LOG2 = 18,         // lse (final or a split's partial) written in base 2
  KDTR_BUG_OUT_TRUNCATE = 19,     // bf16 out: stored values (out, partial rows) rounded toward zero
  KDTR_BUG_MISSING_LOG2E = 20,    // exp2-domain softmax without log2(e): the operator at scale * ln 2
  KDTR_BUG_V_COLUMNS = 21,        // V read from cache columns 64..575
};
