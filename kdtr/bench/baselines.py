"""Torch baselines for `kdtr bench`: the same operator as plain framework code.

torch-eager: bf16 matmuls and an fp32 masked softmax, one request at a time (what a server
without a custom kernel runs). torch-sdpa: scaled_dot_product_attention with a boolean mask.
torch-flex: FlexAttention with a tree mask_mod (compiled; it may refuse Dk = 576). The paged
cache is gathered inside the timed region, as a server would have to. Each baseline reads the
same device buffers as the CUDA kernels (DLPack views of kdtr.launch.DeviceProblem).

sglang-triton: SGLang's own triton kernel with its custom mask, where sglang is installed (kdtr[sglang]);
SKIPPED with the reason where it is not. flashmla-mtp: FlashMLA's causal MTP decode (kdtr/adapters/flashmla.py),
a peer with a chain's mask, checked against the reference under a chain; SKIPPED where FlashMLA does not load.
"""

from __future__ import annotations

import numpy as np

from kdtr.kernels.registry import Caps
from kdtr.inputs.presets import DV
from kdtr.inputs.trees import unpack_mask

CAPS = Caps(kv_dtypes=("bf16",))


def _mm_f32(torch):
    """bf16 x bf16 -> fp32 matmul (torch.mm's out_dtype where this torch has it, else upcast)."""
    a = torch.ones(2, 2, device="cuda", dtype=torch.bfloat16)
    try:
        torch.mm(a, a, torch.float32)
        return lambda x, y: torch.mm(x, y, torch.float32)
    except (TypeError, RuntimeError):
        return lambda x, y: torch.mm(x, y).float()


class Baseline:
    """What every baseline shares: it writes no lse, and ``run`` puts a host Problem on the GPU for its ``run_on``."""

    writes_lse = False

    def run(self, problem, out_dtype: str):
        from kdtr.kernels.launch import DeviceProblem

        return self.run_on(DeviceProblem(problem, out_dtype))


class TorchBaseline(Baseline):
    """One baseline (``impl`` in eager, sdpa, flex); runs on bf16 storage."""

    def __init__(self, impl: str):
        self.impl, self.name, self.caps = impl, f"torch-{impl}", CAPS
        self.broken: str | None = None
        """Set when FlexAttention failed to compile: later shapes fail at once instead of recompiling."""

    def prepare(self, dp):
        import torch

        if self.broken:
            raise RuntimeError(self.broken)

        pr = dp.problem
        T, H, R = pr.T, pr.H, pr.T * pr.H
        q = torch.from_dlpack(dp.q.view("int16")).view(torch.bfloat16).reshape(pr.B, R, -1)
        kv = torch.from_dlpack(dp.kv_cache.view("int16")).view(torch.bfloat16).reshape(-1, pr.kv_cache.shape[-1])
        out_dt = torch.float32 if dp.out_dtype == "fp32" else torch.bfloat16
        out = torch.from_dlpack(dp.out.view("int16") if dp.out_dtype == "bf16" else dp.out)
        out = (out.view(torch.bfloat16) if dp.out_dtype == "bf16" else out).reshape(pr.B, R, DV)
        slots = [torch.as_tensor(pr.tokens(b), device="cuda") for b in range(pr.B)]
        tails = [torch.as_tensor(np.repeat(unpack_mask(pr.tree_mask[b], T), H, axis=0), device="cuda") for b in range(pr.B)]
        P = [int(x) for x in pr.prefix_lens]
        scale = float(pr.scale)
        fn = {"eager": self._eager, "sdpa": self._sdpa, "flex": self._flex}[self.impl]
        go = fn(torch, q, kv, out, out_dt, slots, tails, P, scale, T, H)
        if self.impl == "flex":  # compile now, so a failure is reported once and remembered
            try:
                go()
                torch.cuda.synchronize()
            except Exception as e:
                self.broken = f"FlexAttention failed ({type(e).__name__}: {' '.join(str(e).split())[:120]})"
                raise RuntimeError(self.broken) from None
        return go

    @staticmethod
    def _mask(torch, tail, P):
        return torch.cat([torch.ones(tail.shape[0], P, dtype=torch.bool, device="cuda"), tail], dim=1)

    def _eager(self, torch, q, kv, out, out_dt, slots, tails, P, scale, T, H):
        mm = _mm_f32(torch)

        def go():
            for b in range(q.shape[0]):
                k = kv[slots[b]]  # [P + T, 576] gathered from the pages
                s = mm(q[b], k.t()) * scale  # [R, P + T] bf16 matmul, fp32 scores
                s[:, P[b]:].masked_fill_(~tails[b], float("-inf"))
                p = torch.softmax(s, dim=-1).to(torch.bfloat16)  # fp32 softmax, P rounded to bf16
                out[b].copy_(mm(p, k[:, :DV]).to(out_dt))
        return go

    def _sdpa(self, torch, q, kv, out, out_dt, slots, tails, P, scale, T, H):
        import torch.nn.functional as F

        masks = [self._mask(torch, tails[b], P[b]) for b in range(q.shape[0])]

        def go():
            for b in range(q.shape[0]):
                k = kv[slots[b]]
                o = F.scaled_dot_product_attention(q[b][None], k[None], k[None, :, :DV], attn_mask=masks[b][None], scale=scale)
                out[b].copy_(o[0].to(out_dt))
        return go

    def _flex(self, torch, q, kv, out, out_dt, slots, tails, P, scale, T, H):
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        compiled = torch.compile(flex_attention, dynamic=False)
        runs = []
        for b in range(q.shape[0]):
            full = self._mask(torch, tails[b], P[b])

            def mask_mod(bb, hh, qi, kj, full=full):
                return full[qi, kj]

            bm = create_block_mask(mask_mod, None, None, full.shape[0], full.shape[1], device="cuda")
            runs.append(bm)

        def go():
            for b in range(q.shape[0]):
                k = kv[slots[b]]
                o = compiled(q[b][None, None], k[None, None], k[None, None, :, :DV], block_mask=runs[b], scale=scale)
                out[b].copy_(o[0, 0].to(out_dt))
        return go

    def run_on(self, dp):
        from kdtr.kernels.launch import RunOutput, cupy_module, synchronize

        go = self.prepare(dp)
        dp.poison()
        go()
        synchronize(cupy_module(), self.name)
        out, _ = dp.download()
        return RunOutput(out, None, 0.0)


class SglangTritonBaseline(Baseline):
    """SGLang's own tree verify: its triton extend_attention_fwd with a custom mask (kdtr/adapters/sglang_triton.py),
    on SGLang's target-verify tensors made from the bench's buffers by kdtr.adapters.sglang, once, outside the
    timed region. SKIPPED, with the reason, where sglang's kernel does not load."""

    name = "sglang-triton"
    caps = CAPS

    @property
    def untimed(self) -> str | None:
        """Why there is nothing to time here (sglang missing, or its kernel file not loadable), or None."""
        from kdtr.adapters import sglang_triton

        why = sglang_triton.unavailable_reason()
        return f"{self.name}: {why}" if why else None

    def prepare(self, dp, workspace=None):
        import torch

        from kdtr.adapters.sglang_triton import extend_attention
        from kdtr.kernels.python import PyCallableKernel

        # SGLang's tensors as kdtr bench makes them for any callable of its layout (torch views of device copies)
        args = PyCallableKernel(extend_attention, self.name).prepare(dp).args
        pr = dp.problem
        out = torch.empty(pr.B * pr.T, pr.H, DV, dtype=torch.float32 if dp.out_dtype == "fp32" else torch.bfloat16,
                          device="cuda")
        scale, out_dtype = float(pr.scale), dp.out_dtype

        def go():  # into the one output made here, as a server's preallocated buffer
            extend_attention(*args, scale=scale, out_dtype=out_dtype, out=out)

        go.out, go.args = out, args
        return go

    def run_on(self, dp):
        import torch

        from kdtr.kernels.launch import RunOutput

        go = self.prepare(dp)
        go()
        torch.cuda.synchronize()
        pr = dp.problem
        return RunOutput(go.out.float().cpu().numpy().reshape(pr.B, pr.T, pr.H, DV), None, 0.0)


class FlashMlaMtpPeer(Baseline):
    """FlashMLA's dense decode with s_q = T and a causal mask (kdtr/adapters/flashmla.py): the fastest public MLA
    kernel on Hopper, on the bench's q, block table and lengths and a copy of its cache (page size 64, bf16). Its
    mask is a chain's, so bench_shape checks it against the reference of the same inputs under a chain
    (``tree_family``); its % of roofline is against the tree's floor, as every cell of the row. SKIPPED, with the
    reason, where FlashMLA does not load."""

    name = "flashmla-mtp"
    caps = Caps(kv_dtypes=("bf16",), out_dtypes=("bf16",), page_sizes=(64,), archs=("sm_90",))
    tree_family = "chain"
    """The tree whose mask this peer computes: its output is checked against the reference under it."""

    @property
    def untimed(self) -> str | None:
        """Why there is nothing to time here (FlashMLA missing or not loadable), or None."""
        from kdtr.adapters import flashmla

        why = flashmla.unavailable_reason()
        return f"{self.name}: {why}" if why else None

    def prepare(self, dp, workspace=None):
        import torch

        from kdtr.adapters.flashmla import mtp_decode

        pr = dp.problem
        q = torch.from_dlpack(dp.q.view("int16")).view(torch.bfloat16)  # [B, T, H, 576]
        # FlashMLA loads a request's whole last page, where a NaN in kdtr's unowned slots (there to catch a kernel
        # that reads them) can reach its output through 0 * NaN: it reads a copy of the cache with zeros there, as
        # a server's cache holds finite values past a request's last token
        kv = torch.from_dlpack(dp.kv_cache.view("int16")).view(torch.bfloat16)
        k = torch.nan_to_num(kv, nan=0.0).unsqueeze(2)  # [pages, 64, 1, 576]
        table = torch.from_dlpack(dp.block_table)
        lens = torch.from_dlpack(dp.prefix_lens) + pr.T  # made once, outside the timed region
        go = mtp_decode(q, k, table, lens, float(pr.scale))
        go()  # the first call makes the scheduler metadata; later ones reuse it
        return go

    def run_on(self, dp):
        import torch

        from kdtr.kernels.launch import RunOutput

        out = self.prepare(dp)()
        torch.cuda.synchronize()
        return RunOutput(out.float().cpu().numpy(), None, 0.0)


BASELINES = ("eager", "sdpa", "flex")
OTHER_BASELINES = ("sglang-triton", "flashmla-mtp")
"""Baselines that are not torch code: SGLang's own kernel, FlashMLA's MTP decode."""


def baseline(name: str):
    if name == "sglang-triton":
        return SglangTritonBaseline()
    if name == "flashmla-mtp":
        return FlashMlaMtpPeer()
    impl = name.removeprefix("torch-")
    if impl not in BASELINES:
        raise ValueError(f"unknown baseline {name!r}; known: {', '.join(['torch-' + b for b in BASELINES] + list(OTHER_BASELINES))}")
    return TorchBaseline(impl)
