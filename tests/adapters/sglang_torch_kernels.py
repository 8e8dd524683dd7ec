"""A verify attention in SGLang's target-verify layout on torch tensors (a GPU), as a server-side author would
write it against extend_attention's tensors: eager, one request at a time, the flat bool custom_mask applied
over each request's [T, P + T] scores. For ``kdtr bench -k`` (it reads the index pointers on the host, so it
times as an eager callable does, not as a graph)."""

import torch


def attend(q, k_buffer, v_buffer, kv_indptr, kv_indices, k_extend, v_extend, qo_indptr, custom_mask, mask_indptr,
           *, scale, out_dtype):
    out = torch.empty(q.shape[0], q.shape[1], 512, device=q.device,
                      dtype=torch.float32 if out_dtype == "fp32" else torch.bfloat16)
    kv_ptr, qo_ptr, m_ptr = kv_indptr.tolist(), qo_indptr.tolist(), mask_indptr.tolist()
    for b in range(len(qo_ptr) - 1):
        r0, r1 = qo_ptr[b], qo_ptr[b + 1]
        pre = kv_indices[kv_ptr[b]:kv_ptr[b + 1]]
        k = torch.cat([k_buffer[pre, 0], k_extend[r0:r1, 0]]).float()  # [P + T, 576]
        T = r1 - r0
        seen = custom_mask[m_ptr[b]:m_ptr[b + 1]].view(T, -1)
        s = torch.einsum("thd,jd->thj", q[r0:r1].float(), k) * scale
        s = s.masked_fill(~seen[:, None, :], float("-inf"))
        out[r0:r1] = (torch.softmax(s, -1) @ k[:, :512]).to(out.dtype)
    return out


attend.kdtr_layout = "sglang"
attend.kdtr_framework = "torch"
attend.kdtr_writes_lse = False
