"""FlashMLA's dense MLA decode in its MTP mode, as kdtr can call it: the ``flashmla-mtp`` bench peer
(kdtr/bench/baselines.py).

FlashMLA (deepseek-ai/FlashMLA; packaged for SGLang as ``sgl-flash-mla``, import name ``flash_mla``) is the
fastest public MLA decode kernel on Hopper. It cannot take a tree mask. With s_q = T query tokens a request
and ``causal=True`` (speculative decoding's MTP verify), query token t sees the prefix and tokens 0..t: the
mask of a chain, which a DDTree tree of the same T shares its prefix with and differs from only inside the
tree (T * (T + 1) / 2 pairs against the tree's sum of depths + 1, a few % of the keys at serving prefixes).
So it is timed on the same buffers as kdtr's kernels and checked against kdtr's reference of the same
problem under a chain (kdtr.kernels.launch.DeviceProblem.with_tree).

Its cache layout is kdtr's at page size 64: ``kv_cache [pages, 64, 576]`` viewed ``[pages, 64, 1, 576]``,
``block_table [B, max_pages]``, q ``[B, T, H, 576]``; request b's length is P_b + T. The bench peer hands it a
copy of the cache with zeros in the slots no request owns (NaN in kdtr's layout): FlashMLA loads a request's whole
last page, where a NaN can reach the output through 0 * NaN.
The scheduler's metadata is made by the first call and reused by every later one, as a server reuses it
across layers of a step.
"""

from __future__ import annotations

import importlib
import inspect
from functools import lru_cache

PACKAGE = "flash_mla"
"""FlashMLA's import name (sgl-flash-mla and upstream alike)."""
HEAD_DIM_V = 512


class FlashMlaUnavailable(RuntimeError):
    """FlashMLA cannot be loaded here (not installed, or its extension does not load against this torch)."""


@lru_cache(maxsize=1)
def _outcome():
    """(module, None), or (None, why it cannot be loaded), looked for once a process."""
    if importlib.util.find_spec("torch") is None:
        return None, "FlashMLA needs torch, which is not installed"
    if importlib.util.find_spec(PACKAGE) is None:
        return None, "FlashMLA is not installed (pip install sgl-flash-mla; it needs a torch of its stable ABI)"
    try:
        module = importlib.import_module(PACKAGE)
    except Exception as e:  # an extension built for another torch or CUDA: say which, in one line
        return None, f"cannot load {PACKAGE}: {type(e).__name__}: {' '.join(str(e).split())[:200]}"
    if not hasattr(module, "flash_mla_with_kvcache"):
        return None, f"{PACKAGE} has no flash_mla_with_kvcache"
    if hasattr(module, "has_legacy") and not module.has_legacy():
        return None, f"{PACKAGE} was built without its SM90 (legacy) kernels, which hold dense decoding"
    return module, None


def unavailable_reason() -> str | None:
    """Why FlashMLA cannot be loaded here (one line), or None when it can."""
    return _outcome()[1]


def load():
    """The flash_mla module; FlashMlaUnavailable, one line, where it cannot be loaded."""
    module, why = _outcome()
    if module is None:
        raise FlashMlaUnavailable(why)
    return module


def mtp_decode(q, k_cache, block_table, cache_seqlens, scale: float):
    """A function running FlashMLA's causal MTP decode on these torch tensors (q [B, T, H, 576] bf16, k_cache
    [pages, 64, 1, 576] bf16, block_table [B, max_pages] int32, cache_seqlens [B] int32 = P_b + T), returning
    out [B, T, H, 512] bf16. Its scheduler metadata comes from the first call and is reused by every later one."""
    fm = load()
    call = fm.flash_mla_with_kvcache
    params = inspect.signature(call).parameters
    if "use_legacy" in params:  # sgl-flash-mla: an empty metadata object the first call fills; dense is legacy
        meta, splits = fm.get_mla_metadata()
        kw = dict(use_legacy=True)
    else:  # upstream's interface: the metadata computed from the lengths beforehand
        T, H = q.shape[1], q.shape[2]
        meta, splits = fm.get_mla_metadata(cache_seqlens, T * H, 1)
        kw = {}

    def go():
        return call(q, k_cache, block_table, cache_seqlens, HEAD_DIM_V, meta, splits, softmax_scale=scale,
                    causal=True, **kw)[0]
    return go
