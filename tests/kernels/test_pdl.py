"""Dependent launches (kdtr/kernels/pdl.py), without a GPU: the ctypes structures match cuda.h, arguments
pack to the bytes cupy would pass, a prepared launch keeps its arguments, and every kernel launched
dependent opens with its wait. tests/check/test_gpu_verify.py checks on a GPU that the launch does overlap and the wait
orders it."""

from __future__ import annotations

import ctypes
import re

import numpy as np
import pytest

from kdtr.kernels import contract as abi, nvrtc, pdl
from kdtr.kernels.flash.kernel import DEPENDENT_PREFIX
from kdtr.kernels.nvrtc import CUDA_DIR


def test_structures_have_cuda_h_layout():
    assert ctypes.sizeof(pdl.LaunchAttribute) == 72 and pdl.LaunchAttribute.value.offset == 8
    cfg = pdl.LaunchConfig
    assert (cfg.smem_bytes.offset, cfg.stream.offset, cfg.attrs.offset, cfg.num_attrs.offset) == (24, 32, 40, 48)
    assert ctypes.sizeof(cfg) == 56


@pytest.mark.nvrtc
def test_attribute_id_is_cuda_h_s():
    text = (nvrtc.cuda_include_dir() / "cuda.h").read_text(errors="replace")
    found = re.search(r"CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION\s*=\s*(\d+)", text)
    assert found and int(found.group(1)) == pdl.PROGRAMMATIC_STREAM_SERIALIZATION


def test_arguments_pack_to_their_bytes():
    rec = abi.as_kernel_arg(abi.pack_params(q=1, kv_cache=2, block_table=3, prefix_lens=4, tree_mask=5, out=6, lse=7,
                                            workspace=8, B=1, T=9, H=8, page_size=64, max_pages=3, mask_words=1,
                                            num_pages=3, num_splits=2, scale=0.1))

    class Device:  # a device array: only its pointer travels
        class data:
            ptr = 0xDEADBEEF000

    bufs = pdl.arg_buffers([rec, Device(), np.uint64(7), 5])
    assert bytes(bufs[0]) == rec.tobytes() and len(bytes(bufs[0])) == rec.dtype.itemsize
    assert [bytes(b) for b in bufs[1:]] == [v.to_bytes(8, "little") for v in (0xDEADBEEF000, 7, 5)]


def test_a_prepared_launch_keeps_its_device_tables_alive():
    """The packed bytes hold only a table's address: were the array itself dropped, the memory pool
    could hand its memory to the next allocation before the launch (the work table's job table did so)."""
    import gc
    import weakref

    class Table:
        class data:
            ptr = 0x1000

    table = Table()
    alive = weakref.ref(table)
    launch = pdl.prepare(0x1, (1, 1, 1), (32, 1, 1), 0, (np.uint64(3), table))
    del table
    gc.collect()
    assert alive() is not None
    del launch
    gc.collect()
    assert alive() is None


def _kernel_bodies(source: str):
    """(name, body) of each __global__ kernel of a CUDA source (body up to its closing brace at column 0)."""
    for m in re.finditer(r"__global__ void(?:\s+__\w+__\([^)]*\))?\s+(\w+)\s*\([^{]*?\)\s*\{", source, re.S):
        yield m.group(1), source[m.end():source.index("\n}", m.end())]


WRITTEN_BEFORE = re.compile(r"\bp\.(workspace|out|lse)\b|\bsched_(table|jobs|work)\b|\bmerge_\w+|\bws\b")
"""What a grid before a dependent kernel writes (partials, outputs, the scheduler's tables): never read before
the wait. The kernel's inputs (the prefix lengths, the split table) may be, to overlap that read with it."""


def test_every_dependent_kernel_waits_before_it_reads_what_the_grid_before_writes():
    split = (CUDA_DIR / "flash_split.cuh").read_text()
    merges = [(n, b) for n, b in _kernel_bodies(split) if n.startswith(DEPENDENT_PREFIX)]
    assert len(merges) == 4
    for name, body in merges:
        head, wait, _ = body.partition("kdtr::pdl_wait();")
        code = "\n".join(ln.split("//")[0] for ln in head.splitlines())
        assert wait and not WRITTEN_BEFORE.search(code), (name, code)
    sm90 = dict(_kernel_bodies((CUDA_DIR / "flash_sm90.cu").read_text()))["kdtr_flash_sm90_verify"]
    head, wait, _ = sm90.partition("kdtr::pdl_wait();")  # the work-table build waits for the device scheduler
    assert wait and "sched_table" not in head and "work_table_row" not in head


def test_the_main_kernels_release_their_dependents():
    for src in ("flash.cu", "flash_sm90.cu"):
        mains = [b for n, b in _kernel_bodies((CUDA_DIR / src).read_text()) if not n.startswith(DEPENDENT_PREFIX)]
        assert mains and all("kdtr::pdl_launch_dependents();" in b for b in mains), src

