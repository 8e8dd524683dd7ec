"""What a kernel takes (dtypes, page sizes, tree sizes, heads, archs): a bundle outside it is
SKIPPED with the reason, never run."""

from __future__ import annotations

from dataclasses import dataclass

from kdtr.inputs.presets import DTYPES
from kdtr.kernels import launch


@dataclass(frozen=True)
class Caps:
    """What a kernel takes; anything else is SKIPPED with ``why_not``'s reason."""

    kv_dtypes: tuple[str, ...] = DTYPES
    """Storage dtypes of q and the cache it reads."""
    out_dtypes: tuple[str, ...] = DTYPES
    """Output dtypes it writes."""
    page_sizes: tuple[int, ...] | None = None
    """Cache page sizes it takes (None: any)."""
    max_T: int | None = None
    """Most tree nodes per request (None: any)."""
    max_H: int | None = None
    """Most query heads (None: any)."""
    needs_gpu: bool = True
    """Runs on a CUDA device through cupy (SKIPPED where there is none)."""
    archs: tuple[str, ...] | None = None
    """Device archs (sm_XY) it runs on (None: any); other GPUs SKIP it."""

    def why_not(self, problem, out_dtype: str) -> str | None:
        """Why this kernel cannot run ``problem`` with ``out_dtype``; None when it can."""
        if problem.kv_dtype not in self.kv_dtypes:
            return f"storage dtype {problem.kv_dtype} not supported (takes {', '.join(self.kv_dtypes)})"
        if out_dtype not in self.out_dtypes:
            return f"output dtype {out_dtype} not supported (writes {', '.join(self.out_dtypes)})"
        if self.page_sizes is not None and problem.page_size not in self.page_sizes:
            return f"page size {problem.page_size} not supported (takes {', '.join(map(str, self.page_sizes))})"
        if self.max_T is not None and problem.T > self.max_T:
            return f"T={problem.T} nodes exceeds max_T={self.max_T}"
        if self.max_H is not None and problem.H > self.max_H:
            return f"H={problem.H} heads exceeds max_H={self.max_H}"
        if self.needs_gpu and not launch.gpu_available():
            return "needs a CUDA GPU and cupy; none available here"
        if self.needs_gpu and self.archs is not None and launch.device_arch() not in self.archs:
            return f"needs an {' or '.join(self.archs)} GPU; this one is {launch.device_arch()}"
        return None
