"""``torch.ops.kdtr.tree_verify``: TreeVerify's launch as a torch custom op, so torch.compile traces it as one
opaque call that writes ``out``, ``lse`` and ``workspace`` and CUDA graphs capture it like any kernel.

The op takes a TreeVerify's handle (an int: a torch op cannot take a Python object) and the launch's tensors;
its fake (meta) implementation runs the same shape and dtype checks (kdtr/serving/config.py) and writes nothing.
Registered once, on first use, so importing kdtr.serving needs no torch. (No ``from __future__ import
annotations`` here: torch reads the op's schema from the annotations' objects.)
"""

from functools import lru_cache
from itertools import count
from typing import Optional

from kdtr.errors import InputError
from kdtr.serving.config import VerifyConfig, check_tensors

OP_NAME = "kdtr::tree_verify"
"""The op's qualified name: torch.ops.kdtr.tree_verify."""

_CONFIGS: dict[int, VerifyConfig] = {}
"""handle -> what the TreeVerify was made for (the fake implementation's checks)."""
_LAUNCHERS: dict[int, object] = {}
"""handle -> the TreeVerify (the real implementation's launch)."""
_NEXT = count(1)


def register(cfg: VerifyConfig, launcher=None) -> int:
    """A new handle for ``cfg`` (and the TreeVerify that launches it; None: checks only, e.g. a meta test)."""
    handle = next(_NEXT)
    _CONFIGS[handle] = cfg
    if launcher is not None:
        _LAUNCHERS[handle] = launcher
    return handle


def release(handle: int) -> None:
    """Forget a handle (TreeVerify.close)."""
    _CONFIGS.pop(handle, None)
    _LAUNCHERS.pop(handle, None)


def _config(handle: int) -> VerifyConfig:
    if handle not in _CONFIGS:
        raise InputError(f"{OP_NAME}: no TreeVerify with handle {handle} (closed, or made in another process)")
    return _CONFIGS[handle]


@lru_cache(maxsize=1)
def tree_verify_op():
    """The registered op (torch.ops.kdtr.tree_verify), registering it on the first call."""
    import torch
    from torch import Tensor

    @torch.library.custom_op(OP_NAME, mutates_args=("out", "lse", "workspace"))
    def tree_verify(handle: int, q: Tensor, kv_cache: Tensor, block_table: Tensor, prefix_lens: Tensor,
                    tree_mask: Tensor, out: Tensor, lse: Tensor, workspace: Tensor,
                    req_pool_indices: Optional[Tensor] = None) -> None:
        cfg = _config(handle)
        shape = check_tensors(cfg, q, kv_cache, block_table, prefix_lens, tree_mask, out, lse, workspace,
                              req_pool_indices)
        launcher = _LAUNCHERS.get(handle)
        if launcher is None:
            raise InputError(f"{OP_NAME}: handle {handle} was registered for checks only; make a TreeVerify to launch")
        launcher.launch(shape, q, kv_cache, block_table, prefix_lens, tree_mask, out, lse, workspace, req_pool_indices)

    @tree_verify.register_fake
    def _(handle, q, kv_cache, block_table, prefix_lens, tree_mask, out, lse, workspace, req_pool_indices=None):
        check_tensors(_config(handle), q, kv_cache, block_table, prefix_lens, tree_mask, out, lse, workspace,
                      req_pool_indices)

    return torch.ops.kdtr.tree_verify
