"""TreeVerify: kdtr's verify kernel called from a live server, on its torch tensors and its stream.

Made once per model and shape (T, H, the largest batch and context, page size, dtypes): it compiles and loads
the kernel for the device (flash-sm90 on sm_90, flash elsewhere), sets its attributes and plans a launch for
every batch size it will see, from shapes and the capacity alone (kdtr/kernels/flash/plan.py): what depends on
the lengths is computed on the device at every launch. ``run`` then only checks shapes, packs pointers and
enqueues on ``torch.cuda.current_stream()``: it allocates nothing, reads no device value and synchronises
nothing, so a server captures it in its CUDA graphs at dummy lengths and replays it at the real ones (SPEC
section 8; docs/SERVING.md). One workspace (``new_workspace``) serves every layer.
"""

from __future__ import annotations

from kdtr.errors import InputError
from kdtr.serving import op
from kdtr.serving.config import VerifyConfig, workspace_table


class TreeVerify:
    """The verify launch of one model shape on this GPU; ``run`` per layer and step (see the module docstring)."""

    def __init__(self, *, T: int, H: int, max_batch: int, max_context: int, page_size: int, scale: float,
                 out_dtype: str = "bf16", kv_dtype: str = "bf16", arch: str | None = None, kernel: str | None = None,
                 batch_sizes=None):
        try:
            sizes = None if batch_sizes is None else tuple(batch_sizes)
        except TypeError:
            raise InputError(f"TreeVerify: batch_sizes must be a list of ints, got {batch_sizes!r}") from None
        self.config = cfg = VerifyConfig(T, H, max_batch, max_context, page_size, scale, out_dtype, kv_dtype, arch,
                                         kernel, sizes)
        import torch

        from kdtr.kernels.launch import GpuUnavailable, device_arch
        from kdtr.kernels.registry import resolve_kernel
        from kdtr.kernels.serving import ServingLaunch

        if not torch.cuda.is_available():
            raise GpuUnavailable("TreeVerify needs a CUDA GPU visible to torch")
        here = device_arch()
        if cfg.arch is not None and cfg.arch.removesuffix("a") != here:
            raise InputError(f"TreeVerify: made for {cfg.arch}, but this GPU is {here}")
        self.kernel_name = cfg.kernel_for(here)
        kernel = resolve_kernel(self.kernel_name)
        why = _caps_why_not(kernel.caps, cfg)
        if why:
            raise InputError(f"TreeVerify: {self.kernel_name} cannot serve this shape: {why}")
        launch = ServingLaunch(kernel, cfg.T, cfg.H, cfg.max_pages, cfg.page_size, cfg.kv_dtype, cfg.out_dtype,
                               cfg.scale)
        for index_bytes in (4, 8):  # the gather loaded now, not inside a capture
            launch.gather_kernel(index_bytes)
        self._setup(cfg, launch, torch.device("cuda", torch.cuda.current_device()))
        torch.cuda.synchronize()  # the plans' tables are on the device before any capture

    def _setup(self, cfg: VerifyConfig, launch, device) -> None:
        """Everything after the kernel is loaded: every batch size planned, the buffers, the op's handle. (A test
        passes a stand-in ``launch`` with ``plan``, ``plans``, ``gather`` and ``launch`` to run this on the CPU.)"""
        import torch

        self.config, self._launch, self.device = cfg, launch, device
        self._workspace = workspace_table(cfg.sizes, lambda b: launch.plan(b).workspace_bytes)
        self._lse = torch.empty(cfg.max_batch * cfg.T * cfg.H, dtype=torch.float32, device=device)
        """lse when the caller passes none (the kernels always write one)."""
        self._block_table = torch.zeros(cfg.max_batch, cfg.max_pages, dtype=torch.int32, device=device)
        """The gathered block table of a launch given req_pool_indices."""
        self._no_workspace = torch.empty(0, dtype=torch.uint8, device=device)
        self.handle = op.register(cfg, self)
        op.tree_verify_op()

    def workspace_bytes(self, batch: int | None = None) -> int:
        """Zero-filled bytes a workspace needs to serve every planned batch size up to ``batch`` (default
        max_batch): nondecreasing in ``batch``."""
        cfg = self.config
        batch = cfg.max_batch if batch is None else batch
        if isinstance(batch, bool) or not isinstance(batch, int) or not 1 <= batch <= cfg.max_batch:
            raise InputError(f"TreeVerify.workspace_bytes: batch must be in 1..{cfg.max_batch}, got {batch!r}")
        fit = [b for b in self._workspace if b <= batch]
        return self._workspace[fit[-1]] if fit else 0

    def new_workspace(self, batch: int | None = None):
        """A zero-filled workspace of ``workspace_bytes(batch)`` (at least one byte) on this GPU: allocate it once
        and hand it to every layer's ``run`` (the kernels leave it zeroed for the next launch)."""
        import torch

        return torch.zeros(max(1, self.workspace_bytes(batch)), dtype=torch.uint8, device=self.device)

    def run(self, q, kv_cache, block_table, prefix_lens, tree_mask, out, lse=None, workspace=None,
            req_pool_indices=None) -> None:
        """Enqueue the verify on the current stream; writes ``out`` (and ``lse``).

        q [B*T, H, 576] (or [B, T, H, 576]), kv_cache [slots, 1, 576] or [pages, page_size, 576], block_table
        [>= B, max_pages] int32 (or SGLang's req_to_token, with ``req_pool_indices`` [>= B] naming each request's
        row: the rows the batch reads are gathered on the device into a block table of its own), prefix_lens
        [>= B] int32, tree_mask [B, T, ceil(T/32)] int32 words, out [B*T, H, 512] out dtype, lse [B*T, H] fp32 or
        None, workspace: ``new_workspace()``'s (or None where workspace_bytes() is 0). B comes from q and must be
        a planned batch size. Goes through torch.ops.kdtr.tree_verify, so torch.compile sees one op."""
        if lse is None:  # the internal buffer, cut to this launch's rows (B from q, as check_tensors reads it)
            lse = self._lse[: q.numel() // 576]
        if workspace is None:
            workspace = self._no_workspace
        op.tree_verify_op()(self.handle, q, kv_cache, block_table, prefix_lens, tree_mask, out, lse, workspace,
                            req_pool_indices)

    def launch(self, shape, q, kv_cache, block_table, prefix_lens, tree_mask, out, lse, workspace,
               req_pool_indices) -> None:
        """The op's real implementation, after check_tensors: the workspace checked, pointers packed, enqueued."""
        import torch

        from kdtr.kernels.serving import Buffers

        cfg, B = self.config, shape.B
        if B not in self._launch.plans:
            raise InputError(f"TreeVerify.run: batch {B} was not planned (batch_sizes {list(cfg.sizes)})")
        need = self._launch.plans[B].workspace_bytes
        if workspace.numel() * workspace.element_size() < need:
            raise InputError(f"TreeVerify.run: a batch of {B} needs a workspace of {need} bytes, got "
                             f"{workspace.numel() * workspace.element_size()}; allocate new_workspace() once")
        stream = torch.cuda.current_stream(q.device).cuda_stream if q.is_cuda else 0  # (a CPU stand-in: no stream)
        table, max_pages = block_table.data_ptr(), shape.max_pages
        if req_pool_indices is not None:
            self._launch.gather(B, block_table.data_ptr(), block_table.stride(0), block_table.shape[1],
                                req_pool_indices.data_ptr(), req_pool_indices.element_size(), prefix_lens.data_ptr(),
                                self._block_table.data_ptr(), stream)
            table = self._block_table.data_ptr()
        bufs = Buffers(q.data_ptr(), kv_cache.data_ptr(), table, prefix_lens.data_ptr(), tree_mask.data_ptr(),
                       out.data_ptr(), lse.data_ptr(), workspace.data_ptr() if need else 0, shape.num_pages, max_pages)
        self._launch.launch(B, bufs, stream)

    def close(self) -> None:
        """Forget this TreeVerify's op handle (its buffers go with the object)."""
        op.release(self.handle)


def _caps_why_not(caps, cfg: VerifyConfig) -> str | None:
    """Why the kernel's Caps refuse cfg's dtypes, page size, T, H or this GPU; None when they take it."""
    from types import SimpleNamespace

    shape = SimpleNamespace(kv_dtype=cfg.kv_dtype, page_size=cfg.page_size, T=cfg.T, H=cfg.H)
    return caps.why_not(shape, cfg.out_dtype)

