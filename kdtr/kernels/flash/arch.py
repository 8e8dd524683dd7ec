"""An SM's residency limits, per arch: what kdtr/kernels/flash/plan.py's occupancy counts, for the GPU at hand
(ArchLimits.of its kdtr.kernels.launch.device_info) and for the archs a Force can emulate on it
(``flash[occupancy=sm_120]``: EMULATED_ARCHS). Data only; it imports nothing of kdtr, so force.py (which checks a
suffix's arch) and plan.py (which counts with it) both can."""

from __future__ import annotations

from dataclasses import dataclass

RESERVED_SMEM = 1024
"""Shared memory the hardware reserves for each resident CTA, bytes (sm_80 and later)."""
SMEM_GRANULE = 128
"""A CTA's shared memory (its own and the reserved KB) is allocated in units of this many bytes (sm_80 to sm_120:
CUDA 13.0's cuda_occupancy.h, cudaOccSMemAllocationGranularity)."""


@dataclass(frozen=True)
class ArchLimits:
    """What bounds the CTAs resident on one SM of an arch: the numbers occupancy counts."""

    name: str
    """The arch, e.g. sm_120 (in messages)."""
    smem_per_sm: int
    """Shared memory an SM gives its CTAs, bytes (sharedMemPerMultiprocessor; RESERVED_SMEM a CTA of it reserved)."""
    smem_per_cta: int
    """The most shared memory one CTA may take, static and dynamic, bytes (sharedMemPerBlockOptin)."""
    regs_per_sm: int = 65536
    """32-bit registers of an SM (regsPerMultiprocessor), allocated to warps in 256s."""
    max_threads_per_sm: int = 2048
    """Resident threads an SM (maxThreadsPerMultiProcessor)."""
    max_ctas_per_sm: int = 32
    """Resident CTAs an SM (maxBlocksPerMultiProcessor)."""

    @classmethod
    def of(cls, info: dict) -> ArchLimits:
        """The limits of the GPU that kdtr.kernels.launch.device_info describes (an entry it lacks: the default;
        the per-CTA limit, the SM's less the reserved KB)."""
        return cls(info.get("cc", "this GPU"), info["smem_per_sm"], info.get("smem_optin", info["smem_per_sm"] - RESERVED_SMEM),
                   info["regs_per_sm"], info.get("threads_per_sm", 2048), info.get("ctas_per_sm", 32))


SM_90 = ArchLimits("sm_90", 233472, 232448)
"""The H100 / H200 (compute capability 9.0): 228 KB of shared memory an SM, 227 KB a CTA, 64K registers, 2048
threads, 32 CTAs."""
SM_120 = ArchLimits("sm_120", 102400, 101376, 65536, 1536, 24)
"""The RTX PRO 6000 / RTX 5090 (compute capability 12.0): 100 KB of shared memory an SM, 99 KB a CTA (the KB a CTA
reserved), 64K registers and 1536 threads (48 warps) an SM, as the CUDA C++ Programming Guide's table of compute
capabilities gives them (and SPEC.md section 6); CUDA 13.0's cuda_occupancy.h agrees on the 100 KB (12.x's largest
carve-out) and gives the 24 CTAs an SM (cudaOccMaxBlocksPerMultiprocessor) and the 128-byte units."""
EMULATED_ARCHS = {a.name: a for a in (SM_120,)}
"""The archs whose residency a Force can emulate on the GPU at hand (``flash[occupancy=sm_120]``), by name."""
