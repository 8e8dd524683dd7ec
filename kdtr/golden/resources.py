"""Host-memory estimates, so that a case too big for this machine is refused before any work.

Generating a case holds its inputs, the float64 reference's working set and its outputs at once.
A 1M-token prefix with 128 heads would otherwise compute for minutes and then die in the OOM
killer (or push the machine into swap). ``estimate`` is an upper bound on the peak (the tests hold
it against tracemalloc on real cases); ``check_fits`` compares it with the memory this process can
still get and refuses with one line naming both numbers. ``force`` skips the check.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from kdtr.inputs import rng
from kdtr.inputs.cases import CaseSpec
from kdtr.inputs.presets import DK, DRAFT_DEPTH, DV, VOCAB, dtype_of
from kdtr.inputs.problem import mask_words
from kdtr.golden.reference import chunk_keys

GIB = 1 << 30
PROCESS_BASE = 256 << 20
"""Interpreter, numpy, BLAS buffers: what a kdtr process holds before any case."""
_UNLIMITED = 1 << 60


class ResourceError(ValueError):
    """A case needs more host memory than is available; one line, ``--force`` overrides."""


@dataclass(frozen=True)
class Estimate:
    """Peak host bytes of generating one case (build_bundle + save_bundle), by part."""

    inputs: int
    """q, the paged cache, block table and trees, as stored (held throughout)."""
    generation: int
    """Transient while drawing inputs: float64 generator chunks, one request's pages being filled."""
    reference: int
    """Transient float64 working set of the worst request: q, scores, gathered keys, accumulators."""
    out64: int
    """The float64 reference out and lse (held from the reference until out is rounded)."""
    out32: int
    """The fp32 copy of out that is stored (made while out64 is still held)."""

    @property
    def arrays(self) -> int:
        """Peak bytes of numpy arrays: inputs plus the worst phase."""
        return self.inputs + max(self.generation, self.out64 + max(self.reference, self.out32))

    @property
    def total(self) -> int:
        """What the process needs: arrays plus the interpreter's own memory."""
        return self.arrays + PROCESS_BASE


def estimate(spec: CaseSpec) -> Estimate:
    """Upper bound of the host memory that generating ``spec`` takes (see Estimate)."""
    B, T, H, pg = spec.B, spec.T, spec.H, spec.page_size
    es = dtype_of(spec.kv_dtype).itemsize
    rows = B * T * H
    R = T * H  # query rows of one request
    toks = [p + T for p in spec.prefix_lens]
    pages = [-(-n // pg) for n in toks]
    num_pages = sum(pages) + 1
    K = min(spec.budget, VOCAB)
    small = (B * max(pages) * 4 + B * 4 + 2 * B * T * 4 + 2 * B * T * mask_words(T) * 4  # tables, trees
             + B * DRAFT_DEPTH * K * 8 * 2 + num_pages * 16)  # draft log-probs, page permutation
    inputs = num_pages * pg * DK * es + rows * DK * es + small

    chunk = rng._CHUNK
    # bytes per element of a Stream.normalish chunk: 4 raw uint64 words and their shifted and float64
    # copies (two alive at a time), plus the previous chunk's float64 words and result not yet freed
    draw = 104
    generation = max(
        [draw * min(rows * DK, chunk)]
        + [(n_pg * pg + n) * DK * es + draw * min(n * DK, chunk) for n_pg, n in zip(pages, toks)]
    )

    reference = 0
    for p in spec.prefix_lens:
        c = min(chunk_keys(R), max(p, 1))
        fixed = R * DK * 8 + R * T * 10 + 2 * R * DV * 8 + T * T + 2 * T * DK * 8  # q, e + mask, acc + matmul
        tail = 2 * R * T * 8 + R * T  # scores, exp temporary, inverted mask
        loop = R * max(T, c) * 8 + R * c * 8 + c * (DK * 8 + DV * 8 + DK * es) + 24 * (p + T)  # old + new scores
        reference = max(reference, fixed + max(tail, loop))

    return Estimate(inputs, generation, reference, out64=rows * (DV * 8 + 8), out32=rows * DV * 4)


def available_bytes(meminfo: str = "/proc/meminfo", cgroup: str = "/sys/fs/cgroup") -> int | None:
    """Memory this process can still get: MemAvailable, capped by a cgroup limit; None if unknown."""
    avail = _meminfo_available(meminfo)
    if avail is None:
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            avail = None
    room = _cgroup_room(Path(cgroup))
    if avail is None:
        return room
    return avail if room is None else min(avail, room)


def _meminfo_available(path: str) -> int | None:
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_room(root: Path) -> int | None:
    """limit - usage + reclaimable page cache of this cgroup (v2, else v1); None without a limit."""
    for limit_f, usage_f, stat_f, inactive_key in (
        ("memory.max", "memory.current", "memory.stat", "inactive_file"),
        ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes", "memory/memory.stat", "total_inactive_file"),
    ):
        try:
            text = (root / limit_f).read_text().strip()
            if text == "max" or int(text) >= _UNLIMITED:
                return None
            limit, usage = int(text), int((root / usage_f).read_text())
        except (OSError, ValueError):
            continue
        inactive = 0
        try:
            for line in (root / stat_f).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == inactive_key:
                    inactive = int(value)
        except (OSError, ValueError):
            pass
        return max(0, limit - usage + inactive)
    return None


def human(n: int) -> str:
    """'37.2 GiB' (or MiB below 1 GiB)."""
    return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n / (1 << 20):.1f} MiB"


def check_fits(specs: list[CaseSpec], force: bool = False, limit_bytes: int | None = None, jobs: int = 1) -> None:
    """Raise ResourceError if a case (or ``jobs`` cases at once) would not fit in host memory.

    limit_bytes: the memory to compare with (default: available_bytes(); unknown means no check).
    force: skip the check entirely.
    """
    if force or not specs:
        return
    limit = available_bytes() if limit_bytes is None else limit_bytes
    if limit is None:
        return
    need = sorted(((estimate(s).total, s.name) for s in specs), reverse=True)
    worst, name = need[0]
    if worst > limit:
        more = sum(n > limit for n, _ in need) - 1
        others = f" (and {more} more case{'s' * (more > 1)})" if more else ""
        raise ResourceError(f"{name}: needs ~{human(worst)} of host memory, this machine has {human(limit)} "
                            f"available{others}; use a smaller shape or --force")
    together = sum(n for n, _ in need[: max(1, jobs)])
    if together > limit:
        k = min(jobs, len(need))
        raise ResourceError(f"with -j {jobs} the {k} largest cases need ~{human(together)} of host memory at once, "
                            f"this machine has {human(limit)} available; use fewer jobs, smaller shapes or --force")
