"""A complete verify kernel for kdtr in Python: numpy on the CPU, no GPU (README, "Write and verify your own kernel").

    kdtr verify -k docs/examples/my_verify.py:verify ci
"""
import numpy as np


def verify(q, kv_cache, block_table, prefix_lens, tree_mask, *, scale, page_size, out_dtype):
    B, T, H, _ = q.shape
    out, lse, c = np.empty((B, T, H, 512), np.float32), np.empty((B, T, H), np.float32), np.arange(T)
    for b in range(B):
        P = int(prefix_lens[b])
        j = np.arange(P + T)
        k = kv_cache[block_table[b, j // page_size], j % page_size].astype(np.float32)  # keys [P + T, 576]
        sees = (tree_mask[b][:, c // 32] >> (c % 32).astype(np.uint32)) & 1  # [t, c]: node t sees node c
        visible = np.concatenate([np.ones((T, P), bool), sees.astype(bool)], axis=1)
        s = np.where(visible[:, None], scale * np.einsum("thd,jd->thj", q[b].astype(np.float32), k), -np.inf)
        mx = s.max(-1, keepdims=True)
        e = np.exp(s - mx)
        out[b], lse[b] = e @ k[:, :512] / e.sum(-1, keepdims=True), (mx + np.log(e.sum(-1, keepdims=True)))[..., 0]
    return out, lse  # fp32 out is accepted for either out_dtype


verify.kdtr_device = "cpu"  # numpy arrays in and out; "cuda" (the default) passes cupy arrays
