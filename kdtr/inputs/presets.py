"""The one table of dimensions, models, budgets, edge lengths and dtypes.

Tests, golden suites, the benchmark grid and the CLI all read these names; the CUDA header
``cuda/kdtr_abi.h`` repeats DK/DV/DROPE and a test keeps the two in agreement.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import ml_dtypes
import numpy as np

DK = 576
"""Key / query width: latent 512 + RoPE 64."""
DV = 512
"""Value width: the first 512 columns of the same cache rows."""
DROPE = DK - DV
"""RoPE columns (keys only)."""
DRAFT_DEPTH = 15
"""DDTree drafter depths L = block_size - 1."""
VOCAB = 129280
"""DeepSeek-V3 / Kimi vocabulary size; K = min(budget, VOCAB)."""


@dataclass(frozen=True)
class Model:
    """An MLA model: total query heads and its softmax scale."""

    name: str
    """Preset id used on the command line."""
    heads: int
    """Total query heads (before tensor parallelism)."""
    scale: float
    """192**-0.5 * mscale**2 as the model's config gives it (never 576**-0.5)."""
    tp: int = 8
    """The usual tensor-parallel degree: heads per GPU = heads // tp."""

    def heads_per_gpu(self, tp: int | None = None) -> int:
        tp = self.tp if tp is None else tp
        if tp <= 0 or self.heads % tp:
            raise ValueError(f"{self.name}: {self.heads} heads do not split over TP={tp}")
        return self.heads // tp


MODELS: dict[str, Model] = {
    "deepseek-v3": Model("deepseek-v3", heads=128, scale=0.1352),
    "kimi-k2": Model("kimi-k2", heads=64, scale=0.1447),
}
MODEL_ALIASES = {"dsv3": "deepseek-v3", "kimi": "kimi-k2", "kimi-k2.5": "kimi-k2"}
SHORT = {"deepseek-v3": "dsv3", "kimi-k2": "kimi"}

BUDGETS = (0, 16, 64, 256, 1024)
"""DDTree budgets: 0 is plain decode (T = 1); T = budget + 1."""
PAPER_BUDGETS = (16, 32, 64, 128, 256, 512, 1024)
PAGE_SIZES = (1, 64)
"""SGLang's token pool and FlashMLA's block."""
LONG_PREFIXES = (8192, 32768, 131072)
DTYPES = ("fp32", "bf16")
"""Storage dtypes of q and the cache, and output dtypes."""
BENCH_GRIDS = {
    "compute": dict(models=("deepseek-v3",), tps=(8,), budgets=(64, 256, 512), prefixes=(8192, 32768, 131072), batches=(1, 8)),
    "memory": dict(models=("kimi-k2",), tps=(8,), budgets=(0, 4, 8), prefixes=(32768, 131072), batches=(1, 32)),
}
"""Bench shape sets: DeepSeek TP8 trees (compute-bound) and Kimi TP8 short trees (memory-bound)."""
TREE_FAMILIES = ("ddtree", "chain", "star", "root", "json")
DDTREE_PROFILES = ("confident", "uncertain", "mixed", "bushy")
"""Drafter profiles (kdtr.inputs.trees.synth_logp); "bushy": flat marginals, wide first levels."""
VALUE_KINDS = ("normal", "hard")
"""Value distributions of q and the cache (kdtr.inputs.cases.CaseSpec.values)."""

_NP_DTYPES = {"fp32": np.dtype(np.float32), "bf16": np.dtype(ml_dtypes.bfloat16), "fp64": np.dtype(np.float64)}


def prefix_edges(page_size: int = 64, few_thousand: int = 2500) -> tuple[int, ...]:
    """Prefix lengths where paging and tiling go wrong: 0, 1, page-1, page, page+1, long."""
    pg = max(page_size, 64)  # tile boundaries matter even where pages are one token
    return tuple(sorted({0, 1, pg - 1, pg, pg + 1, few_thousand}))


def model(name: str) -> Model:
    key = MODEL_ALIASES.get(name, name)
    if key not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    return MODELS[key]


def dtype_of(name: str) -> np.dtype:
    if name not in _NP_DTYPES:
        raise ValueError(f"unknown dtype {name!r}; use one of {', '.join(_NP_DTYPES)}")
    return _NP_DTYPES[name]


def dtype_name(dt) -> str:
    dt = np.dtype(dt)
    for k, v in _NP_DTYPES.items():
        if v == dt:
            return k
    raise ValueError(f"unsupported dtype {dt}")


def parse_size(text: str) -> int:
    """'8k' -> 8192, '128K' -> 131072, '1m' -> 1048576, '300' -> 300."""
    t = text.strip().lower()
    mult = 1
    if t.endswith("k"):
        mult, t = 1024, t[:-1]
    elif t.endswith("m"):
        mult, t = 1024 * 1024, t[:-1]
    try:
        v = int(t) * mult
    except ValueError:
        raise ValueError(f"not a size: {text!r} (use e.g. 300, 8k, 128k)") from None
    if v < 0:
        raise ValueError(f"size must be >= 0: {text!r}")
    return v


def parse_int(text: str) -> int:
    """'16' -> 16; anything else (a suffix, a fraction, a sign typo) is a ValueError naming it."""
    t = text.strip()
    if not re.fullmatch(r"-?[0-9]+", t):
        raise ValueError(f"not a whole number: {text!r} (use e.g. 16)")
    return int(t)


def parse_list(text: str, conv=parse_size) -> list:
    """'8k,32k' -> [8192, 32768]; raises ValueError naming the bad item. ``int`` means parse_int."""
    conv = parse_int if conv is int else conv
    items = [s for s in text.split(",") if s.strip()]
    if not items:
        raise ValueError(f"empty list: {text!r}")
    return [conv(s) for s in items]
