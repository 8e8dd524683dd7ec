"""Comparing a kernel's output with the reference (SPEC section 4).

Order of checks, as FlashMLA does it: shape, unwritten (poison) elements, NaN/Inf positions,
then element-wise atol/rtol and the global relative-norm and cosine bounds, then (bf16 outputs) the
rounding bias: the mean signed error in bf16 ulps, which no element bound sees (truncation instead of
round-to-nearest costs half an ulp everywhere, inside every element's bound). The worst element
is named as (b, node, head, dim) and errors are broken down per tree node, per depth, per request
and per head, so a mask bug shows up as whole nodes failing and a batch- or head-indexing bug as
every request (head) but the first failing.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field

import numpy as np

from kdtr.golden.tolerances import BIAS_MAX, BIAS_MIN_COUNT, Tol
from kdtr.kernels.contract import POISON_BF16_BITS, POISON_F32_BITS



class Status(str, enum.Enum):
    PASS = "PASS"
    FAIL_NUMERIC = "FAIL_NUMERIC"
    NAN = "NAN"
    UNWRITTEN = "UNWRITTEN"
    SHAPE = "SHAPE"
    SKIPPED = "SKIPPED"
    RACE = "RACE"
    COMPILE_ERROR = "COMPILE_ERROR"
    RUNTIME_ERROR = "RUNTIME_ERROR"
    TIMEOUT = "TIMEOUT"
    SANITIZER = "SANITIZER"
    CAPTURE_ERROR = "CAPTURE_ERROR"
    """verify --graph: the launch could not be captured into a CUDA graph (it allocated, synchronised or
    copied to or from the host inside the launch)."""

    @property
    def ok(self) -> bool:
        return self is Status.PASS

    @property
    def failed(self) -> bool:
        return self not in (Status.PASS, Status.SKIPPED)


def poison_mask(got: np.ndarray) -> np.ndarray:
    """Elements still holding either poison pattern (got: float32, widened from bf16 by shift)."""
    bits = np.ascontiguousarray(got, dtype=np.float32).view(np.uint32)
    return (bits == POISON_F32_BITS) | (bits == (POISON_BF16_BITS << 16))


@dataclass
class Check:
    """The outcome of comparing one output (out or lse) of one case."""

    output: str
    """"out" or "lse"."""
    status: Status
    """PASS, or the first failing check."""
    tol: Tol
    """The tolerance applied."""
    max_abs: float = 0.0
    """max |got - want| over finite elements."""
    max_rel: float = 0.0
    """max |got - want| / |want| over elements with |want| > atol."""
    ratio: float = 0.0
    """max |got - want| / (atol + rtol |want|): > 1 fails element-wise."""
    rel_norm: float = 0.0
    """||got - want|| / ||want||."""
    cos: float = 1.0
    """cosine similarity of got and want."""
    n_bad: int = 0
    """Elements over the element-wise bound (or unwritten / NaN-mismatched for those statuses)."""
    worst: tuple[int, ...] | None = None
    """Index of the worst element: (b, node, head, dim) for out, (b, node, head) for lse."""
    worst_got: float | None = None
    """got at `worst`."""
    worst_want: float | None = None
    """want at `worst`."""
    bad_nodes: list[int] = field(default_factory=list)
    """Tree nodes (over every request and head) holding a failing element."""
    node_ratio: list[float] = field(default_factory=list)
    """[T] worst ratio per tree node."""
    depth_ratio: dict[int, float] = field(default_factory=dict)
    """Worst ratio per node depth."""
    bad_requests: list[int] = field(default_factory=list)
    """Requests (over every node and head) holding a failing element: a batch-indexing bug fails
    every request but one, or all of them."""
    request_ratio: list[float] = field(default_factory=list)
    """[B] worst ratio per request."""
    bad_heads: list[int] = field(default_factory=list)
    """Heads (over every request and node) holding a failing element."""
    head_ratio: list[float] = field(default_factory=list)
    """[H] worst ratio per head."""
    ulp_bias: float | None = None
    """bf16 outputs: mean of (got - want) * sign(want) / ulp_bf16(want), each term clipped to +-1 ulp, over
    finite normal want: ~0 for round-to-nearest, ~-0.45 for truncation toward zero; |.| > BIAS_MAX fails.
    None where not judged (fp32 output, or fewer than BIAS_MIN_COUNT elements)."""
    ulp_drift: float | None = None
    """Like ulp_bias without the sign orientation: rounding toward -inf or +inf shows here (~-+0.5)."""
    bias_count: int = 0
    """Elements the bias figures are over."""
    where: str = ""
    """Which request, head, node and depth groups hold failing elements, one line ("" when none)."""
    message: str = ""
    """One line for the table."""

    def to_json(self) -> dict:
        d = asdict(self)
        d["status"] = self.status.value
        d["tol"] = self.tol.to_json()
        return d

    @classmethod
    def from_json(cls, d: dict) -> Check:
        """Inverse of ``to_json`` (how a case verified in a child process comes back)."""
        d = dict(d)
        d["status"], d["tol"] = Status(d["status"]), Tol(**d["tol"])
        d["worst"] = None if d.get("worst") is None else tuple(d["worst"])
        d["depth_ratio"] = {int(k): v for k, v in (d.get("depth_ratio") or {}).items()}
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})


def compare(got: np.ndarray, want: np.ndarray, tol: Tol, output: str = "out", depth: np.ndarray | None = None,
            out_dtype: str | None = None) -> Check:
    """Compare got (float32 or float64) with want (float64 reference); depth: [B, T] node depths;
    out_dtype "bf16" adds the rounding-bias check (got holds bf16 values)."""
    if got is None or got.shape != want.shape:
        shape = None if got is None else list(got.shape)
        return Check(output, Status.SHAPE, tol, message=f"{output}: shape {shape}, expected {list(want.shape)}")
    chk = Check(output, Status.PASS, tol)
    unwritten = poison_mask(got)
    if unwritten.any():
        return _flag(chk, Status.UNWRITTEN, unwritten, got, want, f"{int(unwritten.sum())} elements never written",
                     depth)
    g = got.astype(np.float64)
    bad_pos = np.isfinite(g) != np.isfinite(want)
    if bad_pos.any():
        return _flag(chk, Status.NAN, bad_pos, got, want,
                     f"{int(bad_pos.sum())} NaN/Inf where the reference is finite", depth)

    err = np.abs(g - want)
    bound = tol.atol + tol.rtol * np.abs(want)
    ratio = err / bound
    chk.max_abs = float(err.max(initial=0.0))
    big = np.abs(want) > tol.atol
    chk.max_rel = float((err[big] / np.abs(want[big])).max(initial=0.0))
    chk.ratio = float(ratio.max(initial=0.0))
    wn = float(np.linalg.norm(want.ravel()))
    chk.rel_norm = float(np.linalg.norm((g - want).ravel()) / wn) if wn > 0 else float(np.linalg.norm(g))
    gn = float(np.linalg.norm(g.ravel()))
    chk.cos = float(np.dot(g.ravel(), want.ravel()) / (gn * wn)) if gn > 0 and wn > 0 else (1.0 if gn == wn else 0.0)
    over = ratio > 1.0
    chk.n_bad = int(over.sum())
    _locate(chk, ratio, got, want, depth)
    if chk.n_bad:
        chk.status = Status.FAIL_NUMERIC
        chk.message = f"{chk.n_bad} elements over atol+rtol|ref| (worst {chk.ratio:.3g}x)"
    elif chk.rel_norm > tol.rel_norm:
        chk.status = Status.FAIL_NUMERIC
        chk.message = f"relative norm {chk.rel_norm:.3g} > {tol.rel_norm:.3g}"
    elif chk.cos < tol.min_cos:
        chk.status = Status.FAIL_NUMERIC
        chk.message = f"cosine {chk.cos:.8f} < {tol.min_cos}"
    if out_dtype == "bf16":
        chk.ulp_bias, chk.ulp_drift, chk.bias_count = rounding_bias(g, want)
        worst = max((b for b in (chk.ulp_bias, chk.ulp_drift) if b is not None), key=abs, default=0.0)
        if chk.status is Status.PASS and abs(worst) > BIAS_MAX:
            way = ("toward zero" if worst < 0 else "away from zero") if worst == chk.ulp_bias else \
                  ("toward -inf" if worst < 0 else "toward +inf")
            chk.status = Status.FAIL_NUMERIC
            chk.message = (f"rounding bias: mean error {worst:+.2f} bf16 ulp {way} over {chk.bias_count} elements "
                           f"(|bias| > {BIAS_MAX}: not round-to-nearest, e.g. truncation)")
    return chk


BF16_MIN_NORMAL = 2.0**-126
"""Smallest normal bf16 (as fp32): below, the ulp stops scaling with the value."""


def rounding_bias(got: np.ndarray, want: np.ndarray) -> tuple[float | None, float | None, int]:
    """(ulp_bias, ulp_drift, count) of a bf16 output (Check's fields): the mean signed error in units of
    the bf16 ulp at want, oriented by sign(want) and not, each element clipped to +-1 ulp so that
    elements whose error is computational noise of many ulps (small |want| beside large ones) add zero-
    mean terms instead of swamping the half-ulp of a rounding mode. Only finite elements with |want| at
    least the smallest normal count (0 and subnormals have no relative ulp); NaN/Inf positions were
    judged before. (None, None, n) where n < BIAS_MIN_COUNT."""
    w = np.asarray(want, dtype=np.float64)
    g = np.asarray(got, dtype=np.float64)
    sel = np.isfinite(w) & np.isfinite(g) & (np.abs(w) >= BF16_MIN_NORMAL)
    n = int(sel.sum())
    if n < BIAS_MIN_COUNT:
        return None, None, n
    w, g = w[sel], g[sel]
    _, e = np.frexp(w)  # |w| = m 2^e, 0.5 <= m < 1: the bf16 ulp (8 significant bits) is 2^(e - 8)
    err = np.clip((g - w) / np.ldexp(1.0, e - 8), -1.0, 1.0)
    return float((err * np.sign(w)).mean()), float(err.mean()), n


def _locate(chk: Check, score: np.ndarray, got: np.ndarray, want: np.ndarray, depth: np.ndarray | None) -> None:
    """Fill worst element and the per-node / depth / request / head breakdown from a score array
    [B, T, H, ...] (> 1 fails)."""
    flat = int(np.argmax(score))
    idx = np.unravel_index(flat, score.shape)
    chk.worst = tuple(int(i) for i in idx)
    chk.worst_got = float(got[idx])
    chk.worst_want = float(want[idx])
    if score.ndim < 2:
        return
    per_bt = score.reshape(score.shape[0], score.shape[1], -1).max(axis=2)  # [B, T]
    per_node, per_req = per_bt.max(axis=0), per_bt.max(axis=1)
    chk.node_ratio = [float(x) for x in per_node]
    chk.bad_nodes = [int(t) for t in np.nonzero(per_node > 1.0)[0]]
    chk.request_ratio = [float(x) for x in per_req]
    chk.bad_requests = [int(b) for b in np.nonzero(per_req > 1.0)[0]]
    groups = [("requests", chk.bad_requests, list(range(score.shape[0])))]
    per_bth = None
    if score.ndim >= 3:
        per_bth = score.reshape(*score.shape[:3], -1).max(axis=3)  # [B, T, H]
        per_head = per_bth.max(axis=(0, 1))
        chk.head_ratio = [float(x) for x in per_head]
        chk.bad_heads = [int(h) for h in np.nonzero(per_head > 1.0)[0]]
        groups.append(("heads", chk.bad_heads, list(range(score.shape[2]))))
    groups.append(("nodes", chk.bad_nodes, list(range(score.shape[1]))))
    if depth is not None:
        for d in np.unique(depth):
            chk.depth_ratio[int(d)] = float(per_bt[depth == d].max())
        groups.append(("depths", [d for d, r in chk.depth_ratio.items() if r > 1.0], sorted(chk.depth_ratio)))
    if chk.bad_requests:
        chk.where = "; ".join(_groups(name, bad, every) for name, bad, every in groups)
        if per_bth is not None:  # the marginals overstate when only some of their combinations fail
            rows, cells = int((per_bth > 1.0).sum()), len(chk.bad_requests) * len(chk.bad_nodes) * len(chk.bad_heads)
            if rows < cells:
                chk.where += f"; {rows} of those {cells} (request, node, head) rows fail"


def spans(idx) -> str:
    """Sorted indices as ranges: [0, 1, 2, 5, 7, 8] -> "0-2,5,7-8"."""
    idx, parts, i = sorted(int(x) for x in idx), [], 0
    while i < len(idx):
        j = i
        while j + 1 < len(idx) and idx[j + 1] == idx[j] + 1:
            j += 1
        parts.append(str(idx[i]) if i == j else f"{idx[i]}-{idx[j]}")
        i = j + 1
    return ",".join(parts)


def _groups(name: str, bad: list[int], every: list[int]) -> str:
    """The failing ones among ``every``: "requests 1-5 of 0-5 (0 right)", "heads all 16"."""
    if len(bad) == len(every):
        return f"{name} all {len(every)}"
    right = sorted(set(every) - set(bad))  # named when they are the few: "all but request 0"
    return f"{name} {spans(bad)} of {spans(every)}" + (f" ({spans(right)} right)" if len(right) < len(bad) else "")


def _flag(chk: Check, status: Status, mask: np.ndarray, got, want, message: str, depth: np.ndarray | None) -> Check:
    chk.status = status
    chk.n_bad = int(mask.sum())
    _locate(chk, mask.astype(np.float64) * 2.0, got, want, depth)  # bad elements score 2 (> 1)
    chk.message = f"{chk.output}: {message}; first at {chk.worst}"
    return chk


def worst_status(statuses) -> Status:
    """The status that describes a set of checks: the first non-PASS in severity order."""
    order = [
        Status.COMPILE_ERROR, Status.RUNTIME_ERROR, Status.TIMEOUT, Status.SANITIZER, Status.CAPTURE_ERROR, Status.SHAPE,
        Status.UNWRITTEN, Status.NAN, Status.RACE, Status.FAIL_NUMERIC, Status.SKIPPED, Status.PASS,
    ]
    statuses = list(statuses)
    for s in order:
        if s in statuses:
            return s
    return Status.PASS
