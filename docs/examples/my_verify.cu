// A complete verify kernel for kdtr, the shortest correct one: one block of 128 threads per query row,
// fp32 math (README, "Write and verify your own kernel"; the contract is cuda/kdtr_abi.h):
//   kdtr compile -k 'docs/examples/my_verify.cu:my_verify<{kv}, {out}>'
//   kdtr verify  -k 'docs/examples/my_verify.cu:my_verify<{kv}, {out}>' ci
#include "kdtr_abi.h"
#include "kdtr_common.cuh"
extern "C" __constant__ int kdtr_launch[4] = {1, 128, 0, 1};  // rows per block, threads, smem bytes, splits

template <typename KvT, typename OutT>
__global__ void my_verify(const KdtrParams p) {  // grid (T * H, B): block = query row r = t * H + h
  const int R = p.T * p.H, r = blockIdx.x, b = blockIdx.y, t = r / p.H, P = p.prefix_lens[b], tid = threadIdx.x;
  const KvT* q = static_cast<const KvT*>(p.q) + ((long long)b * R + r) * KDTR_DK;
  __shared__ float part[4];
  float m = kdtr::neg_inf(), l = 0.f, acc[4] = {0.f, 0.f, 0.f, 0.f};  // out columns tid + 128 i
  for (int j = 0; j < P + p.T; ++j) {
    if (j >= P && !kdtr::mask_bit(p, b, t, j - P)) continue;  // tree node j - P is not t or its ancestor
    const KvT* k = static_cast<const KvT*>(p.kv_cache) + kdtr::kv_token_offset(p, b, j);
    float s = 0.f;
    for (int d = tid; d < KDTR_DK; d += 128) s += kdtr::to_float(q[d]) * kdtr::to_float(k[d]);
    s = kdtr::warp_sum(s);
    if (tid % 32 == 0) part[tid / 32] = s;
    __syncthreads();
    s = p.scale * (part[0] + part[1] + part[2] + part[3]);
    __syncthreads();
    const float m_new = fmaxf(m, s), c = expf(m - m_new), w = expf(s - m_new);  // online softmax
    l = l * c + w;
    for (int i = 0; i < 4; ++i) acc[i] = acc[i] * c + w * kdtr::to_float(k[tid + 128 * i]);  // V: columns 0:512
    m = m_new;
  }
  OutT* out = static_cast<OutT*>(p.out) + ((long long)b * R + r) * KDTR_DV;
  for (int i = 0; i < 4; ++i) out[tid + 128 * i] = kdtr::from_float<OutT>(acc[i] / l);
  if (tid == 0) p.lse[(long long)b * R + r] = m + logf(l);  // natural log; every row sees itself, so l > 0
}
