"""kdtr's tree verify inside an SGLang-style attention backend (docs/SERVING.md walks through it).

    python docs/examples/serving_example.py      # a CUDA GPU with torch and cupy: pip install 'kdtr[cuda13,serving]'

Two MLA layers on SGLang's page-size-1 token pool (a k_buffer per layer; req_to_token rows picked by
req_pool_indices) verify a batch of DDTree trees. The backend fills its metadata outside the CUDA graph; the
layers' calls are captured once, at SGLang's dummy lengths (every prefix 1, a chain tree), and replayed at each
step's real lengths and trees; every layer's output is checked against a float32 torch reference. Prints one
line per step and exits 1 on a mismatch.
"""

from __future__ import annotations

import sys

import numpy as np
import torch

from kdtr.inputs.trees import chain, ddtree_from_seed, pack_mask, visible_matrix
from kdtr.serving import TreeVerify


class KdtrVerifyBackend:
    """What an SGLang attention backend's target-verify path needs: one TreeVerify, one workspace and the static
    metadata buffers its graphs read, for every layer."""

    def __init__(self, *, max_bs: int, T: int, H: int, max_context: int, scale: float):
        self.T = T
        self.verify = TreeVerify(T=T, H=H, max_batch=max_bs, max_context=max_context, page_size=1, scale=scale)
        self.workspace = self.verify.new_workspace()  # one for all layers, zeroed once
        self.prefix_lens = torch.ones(max_bs, dtype=torch.int32, device="cuda")
        self.tree_mask = torch.zeros(max_bs, T, -(-T // 32), dtype=torch.int32, device="cuda")

    def init_forward_metadata(self, seq_lens: torch.Tensor, tree_mask: torch.Tensor) -> None:
        """Outside the graph, once per step: the real prefix lengths and trees into the static buffers."""
        bs = seq_lens.shape[0]
        self.prefix_lens[:bs].copy_(seq_lens)  # SGLang's int64 seq_lens become int32 here
        self.tree_mask[:bs].copy_(tree_mask)

    def forward_target_verify(self, q, k_buffer, req_to_token, req_pool_indices, out) -> None:
        """Inside the graph, once per layer: q [bs*T, H, 576], this layer's k_buffer [slots, 1, 576] (V is its first
        512 columns), out [bs*T, H, 512]."""
        bs = q.shape[0] // self.T
        self.verify.run(q, k_buffer, req_to_token, self.prefix_lens[:bs], self.tree_mask[:bs], out,
                        workspace=self.workspace, req_pool_indices=req_pool_indices[:bs])


def reference(q, k_buffer, slots, parents, scale, T):
    """float32 torch: each request's nodes over its prefix and its ancestors (q [bs*T, H, 576])."""
    outs = []
    for b, (tok, parent) in enumerate(zip(slots, parents)):
        k = k_buffer[tok, 0].float()  # [P + T, 576]
        s = torch.einsum("thd,jd->thj", q[b * T:(b + 1) * T].float(), k) * scale
        P = len(tok) - T
        seen = torch.ones(T, P + T, dtype=torch.bool, device="cuda")
        seen[:, P:] = torch.as_tensor(visible_matrix(parent), device="cuda")
        s = s.masked_fill(~seen[:, None, :], float("-inf"))
        outs.append(torch.softmax(s, -1) @ k[:, :512])
    return torch.cat(outs)


def main() -> int:
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    layers, H, budget, max_bs, max_context, scale = 2, 16, 16, 4, 4096, 0.1352
    T, slots_total, pool_rows = budget + 1, 16384, 8
    backend = KdtrVerifyBackend(max_bs=max_bs, T=T, H=H, max_context=max_context, scale=scale)

    k_buffers = [torch.randn(slots_total, 1, 576, device="cuda").to(torch.bfloat16) for _ in range(layers)]
    req_to_token = torch.zeros(pool_rows, max_context, dtype=torch.int32, device="cuda")
    rows = [5, 0, 2]  # each request's row of the pool
    req_pool_indices = torch.tensor(rows, dtype=torch.int64, device="cuda")
    bs = len(rows)
    qs = [torch.empty(bs * T, H, 576, dtype=torch.bfloat16, device="cuda") for _ in range(layers)]
    outs = [torch.empty(bs * T, H, 512, dtype=torch.bfloat16, device="cuda") for _ in range(layers)]

    def forward():  # what the model's graph holds: every layer's verify
        for i in range(layers):
            backend.forward_target_verify(qs[i], k_buffers[i], req_to_token, req_pool_indices, outs[i])

    # capture once at SGLang's dummy state: every prefix 1, a chain tree
    dummy = torch.as_tensor(pack_mask(chain(T).parent).view(np.int32), device="cuda")
    backend.init_forward_metadata(torch.ones(bs, dtype=torch.int64, device="cuda"), dummy.expand(bs, -1, -1))
    for q in qs:
        q.normal_()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        forward()  # the warm-up torch asks for before a capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()

    worst = 0.0
    for step, prefix_lens in enumerate([(100, 1000, 7), (3000, 33, 0), (1, 2048, 513)]):
        slots, parents = [], []
        for b, P in enumerate(prefix_lens):  # a step's tokens: SGLang's allocator scatters them over the pool
            tok = torch.as_tensor(rng.choice(slots_total, P + T, replace=False).astype(np.int32), device="cuda")
            req_to_token[rows[b], :P + T] = tok
            slots.append(tok.long())
            parents.append(ddtree_from_seed(step, b, budget, "mixed").parent)
        masks = torch.as_tensor(np.stack([pack_mask(p) for p in parents]).view(np.int32), device="cuda")
        backend.init_forward_metadata(torch.tensor(prefix_lens, device="cuda"), masks)
        for q in qs:
            q.normal_()
        graph.replay()
        refs = [reference(qs[i], k_buffers[i], slots, parents, scale, T) for i in range(layers)]
        errs = [float(((outs[i].float() - refs[i]).abs() / (1 + refs[i].abs())).max()) for i in range(layers)]
        worst = max(worst, *errs)
        print(f"step {step}: prefixes {prefix_lens}, {backend.verify.kernel_name}, max |out - ref| / (1 + |ref|) per layer "
              + ", ".join(f"{e:.4f}" for e in errs))
    ok = worst < 0.02  # a bf16 output: a few bf16 ulps (2^-8 relative)
    print("OK" if ok else f"MISMATCH: {worst:.4f}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
