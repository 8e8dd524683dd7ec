// kdtr_common.cuh -- small device helpers shared by kdtr's verify kernels.
//
// Storage loads to float (float and __nv_bfloat16), float stores to the output type, the paged
// cache address of a request's token, the tree-mask bit test and warp reductions. Everything is
// in namespace kdtr and __forceinline__; no state, no host code.

#pragma once

#include <cuda_bf16.h>

#include "kdtr_abi.h"

namespace kdtr {

// ---- storage type -> float ------------------------------------------------------------------

template <typename T>
__device__ __forceinline__ float to_float(T x);

template <>
__device__ __forceinline__ float to_float<float>(float x) { return x; }

template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }

// Four consecutive elements starting at p (p 8-byte aligned for bf16, 16-byte aligned for float).
template <typename T>
__device__ __forceinline__ float4 load_float4(const T* p);

template <>
__device__ __forceinline__ float4 load_float4<float>(const float* p) {
  return *reinterpret_cast<const float4*>(p);
}

template <>
__device__ __forceinline__ float4 load_float4<__nv_bfloat16>(const __nv_bfloat16* p) {
  const uint2 raw = *reinterpret_cast<const uint2*>(p);
  const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.x));
  const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&raw.y));
  return make_float4(lo.x, lo.y, hi.x, hi.y);
}

// ---- float -> output type (round to nearest even) --------------------------------------------

template <typename T>
__device__ __forceinline__ T from_float(float x);

template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }

template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// ---- paged cache and tree mask ---------------------------------------------------------------

// Element offset into kv_cache of the row holding slot `offset` of the request's `page_index`-th
// page. 64-bit: num_pages * page_size * 576 exceeds 2^31 for long batches.
__device__ __forceinline__ long long kv_slot(const KdtrParams& p, int page, int offset) {
  return (long long)page * p.page_size + offset;  // cache row (slot); `page`: a block-table entry
}
__device__ __forceinline__ long long kv_page_row(const KdtrParams& p, int page, int offset) {
  return kv_slot(p, page, offset) * KDTR_DK;
}
__device__ __forceinline__ long long kv_row_offset(const KdtrParams& p, int b, int page_index, int offset) {
  return kv_page_row(p, p.block_table[(long long)b * p.max_pages + page_index], offset);
}

// Element offset into kv_cache of token j of request b (j in [0, P_b + T)).
__device__ __forceinline__ long long kv_token_offset(const KdtrParams& p, int b, int j) {
  return kv_row_offset(p, b, j / p.page_size, j % p.page_size);
}

// The packed mask row of node t of request b: mask_words unsigned words.
__device__ __forceinline__ const unsigned* mask_row(const KdtrParams& p, int b, int t) {
  return p.tree_mask + ((long long)b * p.T + t) * p.mask_words;
}

// Does node t of request b see tree node c (0 <= c < T)?
__device__ __forceinline__ bool mask_bit(const KdtrParams& p, int b, int t, int c) {
  return (mask_row(p, b, t)[c / KDTR_MASK_BITS] >> (c % KDTR_MASK_BITS)) & 1u;
}

// ---- shared-memory addresses, cp.async (sm_80+), 4-byte bf16 pair loads -----------------------

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// 16-byte async copy global -> shared; zero-fills when !valid (src is not read then).
__device__ __forceinline__ void cp_async16(unsigned dst, const void* src, bool valid) {
  const int n = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ unsigned ld_u32(const __nv_bfloat16* p) { return *reinterpret_cast<const unsigned*>(p); }

// ---- ldmatrix and mma.sync (sm_80+): flash.cu's products, flash_sm90.cu's transposed rows --

__device__ __forceinline__ void ldsm_x4(unsigned (&r)[4], unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_trans(unsigned (&r)[4], unsigned addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// two floats as the bf16 pair of one 32-bit mma operand register (lo in the low half), rounded to nearest
__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const unsigned*>(&v);
}

// C[16x8] += A[16x16] (row) * B[16x8] (col), bf16 in, fp32 accumulate.
__device__ __forceinline__ void mma_bf16(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ---- two adjacent floats to the output type (8 or 4 bytes, aligned) ---------------------------

template <typename OutT>
__device__ __forceinline__ void store2(OutT* dst, float x, float y);
template <>
__device__ __forceinline__ void store2<float>(float* dst, float x, float y) {
  *reinterpret_cast<float2*>(dst) = make_float2(x, y);
}
template <>
__device__ __forceinline__ void store2<__nv_bfloat16>(__nv_bfloat16* dst, float x, float y) {
  *reinterpret_cast<__nv_bfloat162*>(dst) = __floats2bfloat162_rn(x, y);
}

// ---- programmatic dependent launch (sm_90+; no-ops below sm_90 and for launches that did not ask) ----

// the next launch of the stream may be scheduled now (kdtr/kernels/launch.py marks it dependent); its wait
// below still holds it until this grid has finished and its writes are visible
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
// the first statement of a kernel launched as dependent: returns once the previous grid is done
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// ---- constants of the exp2-domain softmax ---------------------------------------------------------

constexpr float LOG2E = 1.4426950408889634f;  // log2(e): exp(x) = exp2(x * LOG2E)
constexpr float LN2 = 0.6931471805599453f;    // ln(2): ln(x) = log2(x) * LN2

// ---- -infinity (NVRTC has no <cmath> INFINITY) -------------------------------------------------

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000u); }

// ---- warp reductions (all 32 lanes must call; WIDTH-lane groups, WIDTH a power of two <= 32) --

template <int WIDTH = 32>
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int off = WIDTH / 2; off > 0; off /= 2) x += __shfl_xor_sync(0xffffffffu, x, off);
  return x;
}

template <int WIDTH = 32>
__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int off = WIDTH / 2; off > 0; off /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, off));
  return x;
}

}  // namespace kdtr
