"""The device half of a flash launch plan: Python's side of cuda/flash_sched.cuh's ``FlashSched``.

A flash launch passes one FlashSched by value beside KdtrParams to each of its kernels: the split table (each
request's split count by its prefix length, looked up on the device) and, for flash-sm90's work-table plans,
the recipe the device scheduler applies and where in the workspace it writes the tables. Everything in it
comes from the host plan (shapes and a capacity), so a launch captured in a CUDA graph stays right when it is
replayed at other lengths. ``FIELDS`` and the constants below mirror the header; tests/kernels/test_device_plan.py
parses the header and keeps them equal. No GPU needed.
"""

from __future__ import annotations

import numpy as np

from kdtr.kernels.contract import pack_struct, struct_dtype

HEADER_NAME = "flash_sched.cuh"
"""The header (in kdtr's cuda/ folder) that declares FlashSched and the constants below."""
FIELDS: tuple[tuple[str, str], ...] = (
    ("splits", "const int*"),
    ("table_offset", "long long"),
    ("tiles_cap", "int"),
    ("tile_shift", "int"),
    ("max_pieces", "int"),
    ("max_jobs", "int"),
    ("family", "int"),
    ("target", "int"),
    ("interval", "int"),
    ("whole", "int"),
    ("row_tiles", "int"),
    ("rows_per_tile", "int"),
)
"""(field, C type) of FlashSched in declaration order, as the header spells them."""
DTYPE = struct_dtype(FIELDS)
"""One FlashSched record."""

SCHED_HEADER = 4
"""Ints of the table region before its work rows (pieces, cut jobs, two spare)."""
SCHED_SCRATCH = 5
"""Ints of the scheduler's scratch row per piece."""
SCHED_THREADS = 1024
"""Threads of kdtr_flash_schedule's one CTA."""
SCHED_MAX_PIECES = SCHED_MAX_JOBS = 4096
"""Pieces the scheduler sorts, jobs it takes (plan.py's MAX_TABLE_PIECES, MAX_TABLE_JOBS keep plans within them)."""
SCHED_SMEM_BYTES = SCHED_MAX_PIECES * 8 + 9 * SCHED_MAX_JOBS * 4 + (SCHED_THREADS // 32 + 1) * 4
"""kdtr_flash_schedule's dynamic shared memory (the header's SCHED_SMEM_BYTES)."""
SCHEDULE_KERNEL = "kdtr_flash_schedule"
"""The device scheduler's symbol (flash_schedule.cuh; flash-sm90's module)."""
NO_TABLE = -1
"""table_offset of a uniform plan."""


def table_ints(max_pieces: int, max_jobs: int, work_ints: int, job_ints: int) -> int:
    """Ints of the work-table region of a plan making at most ``max_pieces`` pieces of ``max_jobs`` jobs."""
    return SCHED_HEADER + max_pieces * work_ints + max_jobs * job_ints + max_pieces * SCHED_SCRATCH


def pack(**fields) -> np.ndarray:
    """A FlashSched record (every field required) as a one-element array, the kernel argument's bytes."""
    arr = np.zeros(1, DTYPE)
    arr[0] = pack_struct("FlashSched", FIELDS, DTYPE, fields)
    return arr


def tile_shift(bn: int) -> int:
    """log2 of a power-of-two tile (the split table's key); ValueError otherwise."""
    if bn < 1 or bn & (bn - 1):
        raise ValueError(f"the split table needs a power-of-two KV tile, got {bn}")
    return bn.bit_length() - 1
