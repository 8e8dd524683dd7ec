"""kdtr's verify kernel inside a server: TreeVerify (torch tensors, the server's stream, CUDA-graph safe) and its
custom op torch.ops.kdtr.tree_verify (docs/SERVING.md). Sits above kdtr.kernels; needs torch only when a
TreeVerify is made."""

from kdtr.serving.config import VerifyConfig, check_tensors, workspace_table
from kdtr.serving.verify import TreeVerify

__all__ = ["TreeVerify", "VerifyConfig", "check_tensors", "workspace_table"]
