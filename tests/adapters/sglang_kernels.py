"""A verify attention written in SGLang's target-verify layout (numpy, CPU), as a server-side author
would write it against extend_attention's tensors, and the same with a planted bug."""

import numpy as np


def _attend(q, k_buffer, v_buffer, kv_indptr, kv_indices, k_extend, v_extend, qo_indptr, custom_mask,
            mask_indptr, *, scale, out_dtype, use_mask=True):
    H = q.shape[1]
    out, lse = np.empty((q.shape[0], H, 512), np.float32), np.empty((q.shape[0], H), np.float32)
    for b in range(kv_indptr.shape[0] - 1):
        r0, r1 = int(qo_indptr[b]), int(qo_indptr[b + 1])
        T, pre = r1 - r0, kv_indices[kv_indptr[b] : kv_indptr[b + 1]]
        P = pre.shape[0]
        k = np.concatenate([k_buffer[pre, 0], k_extend[r0:r1, 0]]).astype(np.float32)  # [P + T, 576]
        v = np.concatenate([v_buffer[pre, 0], v_extend[r0:r1, 0]]).astype(np.float32)  # [P + T, 512]
        if custom_mask.dtype == np.bool_:
            seen = custom_mask[mask_indptr[b] : mask_indptr[b + 1]].reshape(T, P + T)
        else:  # one word per query row: bit c iff the row sees tree node c; the prefix is always seen
            words = custom_mask[mask_indptr[b] : mask_indptr[b] + T].astype(np.int64)
            tree = ((words[:, None] >> np.arange(T)) & 1).astype(bool)
            seen = np.concatenate([np.ones((T, P), bool), tree], axis=1)
        if not use_mask:
            seen = np.ones_like(seen)
        s = scale * np.einsum("thd,jd->thj", q[r0:r1].astype(np.float32), k)
        s = np.where(seen[:, None, :], s, -np.inf)
        mx = s.max(-1, keepdims=True)
        e = np.exp(s - mx)
        out[r0:r1] = e @ v / e.sum(-1, keepdims=True)
        lse[r0:r1] = (mx + np.log(e.sum(-1, keepdims=True)))[..., 0]
    return out, lse


def attend(*args, **kw):
    return _attend(*args, **kw)


def attend_bitpacked(*args, **kw):
    return _attend(*args, **kw)


def ignores_mask(*args, **kw):
    return _attend(*args, **kw, use_mask=False)


def flat_out(*args, **kw):
    out, lse = _attend(*args, **kw)
    return out.reshape(-1, 512), lse


def unknown_layout(*args, **kw):
    return _attend(*args, **kw)


for fn in (attend, attend_bitpacked, ignores_mask, flat_out, unknown_layout):
    fn.kdtr_device = "cpu"
    fn.kdtr_layout = "sglang"
attend_bitpacked.kdtr_layout = "sglang-bitpacked"
unknown_layout.kdtr_layout = "vllm"
