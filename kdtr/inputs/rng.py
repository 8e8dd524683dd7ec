"""Deterministic random numbers from raw generator bits.

numpy guarantees the raw bit stream of PCG64 across versions and machines, but not its
distribution methods (``normal``, ``permutation``...) nor the last ulp of SIMD transcendental
functions. Everything kdtr stores is therefore derived from raw 64-bit words with exact
arithmetic only (integer ops, adds and multiplies by powers of two), so the same seed gives
byte-identical inputs everywhere.
"""

from __future__ import annotations

import hashlib

import numpy as np

_TWO_M53 = 2.0**-53
_CHUNK = 1 << 20
"""Elements generated at a time (bounds the float64 temporaries)."""


class Stream:
    """A named, seeded stream of raw 64-bit words with exact transforms on top."""

    def __init__(self, seed: int, *names: str | int):
        # Derive an independent 128-bit key per (seed, names) so that adding a tensor or a case
        # never shifts the values of another.
        tag = "/".join([str(int(seed))] + [str(n) for n in names]).encode()
        key = int.from_bytes(hashlib.sha256(tag).digest()[:16], "little")
        self._bits = np.random.PCG64(key)

    def raw(self, n: int) -> np.ndarray:
        """n raw uint64 words (stable across numpy versions)."""
        if n == 0:
            return np.zeros(0, dtype=np.uint64)
        return np.asarray(self._bits.random_raw(n), dtype=np.uint64)

    def uniform(self, shape) -> np.ndarray:
        """float64 in [0, 1) with 53 random bits; exact."""
        n = int(np.prod(shape, dtype=np.int64))
        u = (self.raw(n) >> np.uint64(11)).astype(np.float64) * _TWO_M53
        return u.reshape(shape)

    def normalish(self, shape, std: float = 1.0, dtype=np.float64) -> np.ndarray:
        """Approximately normal values (Irwin-Hall sum of 4 uniforms, unit variance), cast to dtype.

        Bounded (|x| < 3.47 std) and exact: only adds and power-of-two multiplies, then one
        multiply by sqrt(3) * std (correctly rounded on every IEEE machine). Element i uses raw
        words 4i..4i+3, so the values do not depend on the chunking used to bound memory.
        """
        n = int(np.prod(shape, dtype=np.int64))
        out = np.empty(n, dtype=dtype)
        for start in range(0, n, _CHUNK):
            m = min(_CHUNK, n - start)
            u = (self.raw(4 * m) >> np.uint64(11)).astype(np.float64).reshape(m, 4) * _TWO_M53
            x = (u[:, 0] + u[:, 1]) + (u[:, 2] + u[:, 3]) - 2.0  # mean 0, variance 4/12
            x = x * (np.sqrt(3.0) * std)
            if out.dtype.itemsize < 4:  # bf16: via fp32, both steps IEEE round-to-nearest-even
                x = x.astype(np.float32)
            out[start : start + m] = x
        return out.reshape(shape)

    def integers(self, n: int, high: int) -> np.ndarray:
        """n integers in [0, high), by exact 64-bit multiply-shift (bias below 2**-40)."""
        if high <= 0:
            raise ValueError("high must be positive")
        r = self.raw(n) >> np.uint64(32)  # 32 random bits
        return ((r * np.uint64(high)) >> np.uint64(32)).astype(np.int64)

    def permutation(self, n: int) -> np.ndarray:
        """A uniform permutation of range(n) by Fisher-Yates over raw words."""
        perm = np.arange(n, dtype=np.int64)
        if n < 2:
            return perm
        words = self.raw(n - 1) >> np.uint64(11)
        for i in range(n - 1, 0, -1):
            j = int(words[n - 1 - i]) % (i + 1)
            perm[i], perm[j] = perm[j], perm[i]
        return perm
