"""The exact reference: SPEC section 1 in float64, on the inputs as stored.

Nothing else lives here, so the oracle can be read in one sitting. Keys are processed in
chunks with an online (running-max) softmax, so a 128k-token prefix never needs a
[rows, P] float64 matrix; every chunk is two BLAS products (scores, then P @ V).
"""

from __future__ import annotations

import numpy as np

from kdtr.inputs.presets import DK, DV
from kdtr.inputs.trees import unpack_mask
from kdtr.inputs.problem import Problem

CHUNK_ELEMS = 1 << 24
"""Score-matrix elements per chunk (128 MiB of float64); bounds peak memory."""


def chunk_keys(rows: int, chunk_elems: int = CHUNK_ELEMS) -> int:
    """Keys per chunk for `rows` query rows: large for BLAS efficiency, bounded for memory."""
    return int(max(256, min(16384, (chunk_elems // max(rows, 1)) // 256 * 256)))


def reference_request(p: Problem, b: int, chunk: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """out [T, H, 512] and lse [T, H] (float64) of request b."""
    out, lse, _ = _request(p, b, chunk)
    return out, lse


def _request(p: Problem, b: int, chunk: int | None = None) -> tuple[np.ndarray, np.ndarray, float]:
    """out [T, H, 512], lse [T, H] and the largest |scaled score| over visible pairs of request b."""
    T, H = p.T, p.H
    P = int(p.prefix_lens[b])
    R = T * H  # rows ordered (node, head)
    q = p.q[b].reshape(R, DK).astype(np.float64) * p.scale  # [R, 576]
    chunk = chunk or chunk_keys(R)

    # Tail first: every row sees itself, so the running max is finite before any prefix chunk.
    k_tail = p.gather_kv(b, P, P + T)  # [T, 576]
    s = q @ k_tail.T  # [R, T]
    visible = np.repeat(unpack_mask(p.tree_mask[b], T), H, axis=0)  # [R, T]
    s[~visible] = -np.inf
    m = s.max(axis=1)  # [R]
    smax = float(np.abs(s[visible]).max())  # every row sees itself: never empty
    e = np.exp(s - m[:, None])
    l = e.sum(axis=1)  # [R]
    acc = e @ k_tail[:, :DV]  # [R, 512]

    for start in range(0, P, chunk):
        k = p.gather_kv(b, start, min(P, start + chunk))  # [c, 576]
        s = q @ k.T  # [R, c]
        smax = max(smax, float(np.abs(s).max()))
        m_new = np.maximum(m, s.max(axis=1))
        alpha = np.exp(m - m_new)
        s -= m_new[:, None]
        np.exp(s, out=s)
        l = l * alpha + s.sum(axis=1)
        acc *= alpha[:, None]
        acc += s @ k[:, :DV]
        m = m_new

    out = acc / l[:, None]
    lse = m + np.log(l)
    return out.reshape(T, H, DV), lse.reshape(T, H), smax


def reference(p: Problem, chunk: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """out [B, T, H, 512] and lse [B, T, H] in float64 (natural-log LSE)."""
    out, lse, _ = reference_with_score(p, chunk)
    return out, lse


def reference_with_score(p: Problem, chunk: int | None = None) -> tuple[np.ndarray, np.ndarray, float]:
    """reference() and max |scale * q.k| over every visible (row, key) pair: the conditioning the
    tolerances scale with (kdtr.golden.tolerances.scaled)."""
    out = np.empty((p.B, p.T, p.H, DV), dtype=np.float64)
    lse = np.empty((p.B, p.T, p.H), dtype=np.float64)
    smax = 0.0
    for b in range(p.B):
        out[b], lse[b], s = _request(p, b, chunk)
        smax = max(smax, s)
    return out, lse, smax


def score_bounds(p: Problem, chunk: int = 1 << 14) -> tuple[float, float]:
    """(Cauchy-Schwarz bound on every |scaled score|, max |v|) from the stored inputs, in one pass over
    each request's keys: scale * max ||q_row|| * max ||k_j||, and the largest value-column magnitude.
    Cheap next to the reference; verify caps a bundle's recorded score with the first and scales out's
    bounds with the second. Non-finite inputs give inf / nan, which the tolerance module refuses."""
    cap, vmax = 0.0, 0.0
    for b in range(p.B):
        qn = float(np.sqrt((p.q[b].astype(np.float64) ** 2).sum(axis=-1)).max())
        n, kn = int(p.prefix_lens[b]) + p.T, 0.0
        for start in range(0, n, chunk):
            k = p.gather_kv(b, start, min(n, start + chunk))  # [c, 576]
            kn = max(kn, float(np.sqrt((k ** 2).sum(axis=1)).max()))
            vmax = max(vmax, float(np.abs(k[:, :DV]).max()))
        cap = max(cap, abs(p.scale) * qn * kn)
    return cap, vmax

