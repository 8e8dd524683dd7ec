"""The KV cache's TMA map spec (pure arithmetic; encoding it needs the CUDA driver, tested on a GPU
in tests/check/test_gpu_verify.py), and that its box is the tile the kernel copies."""

import re

import pytest

from kdtr.kernels.flash import tma
from kdtr.kernels.flash.kernel import FLASH_SM90
from kdtr.inputs.presets import DK


def test_spec_sees_every_cache_slot_as_nine_slabs():
    """Dimension 0: a slab's 64 columns; 1: the slots (1152-byte rows); 2: the 9 slabs (128 bytes
    apart), outermost, so a box lands slab by slab as the kernel's stage layout wants."""
    t = tma.kv_map_spec(num_pages=37, page_size=64, dk=DK, box_cols=64, box_rows=32, box_slabs=9)
    assert t.dims == (64, 37 * 64, 9) and t.strides == (1152, 128) and t.box == (64, 32, 9)
    assert tma.kv_map_spec(3, 1, DK, 64, 32, 3).box == (64, 32, 3)


@pytest.mark.parametrize("kw, what", [
    (dict(box_cols=32), "128-byte"),           # a 64-byte box row cannot take the 128-byte swizzle
    (dict(box_rows=300), "rows 1..256"),
    (dict(dk=570), "do not split"),
    (dict(box_slabs=4), "whole boxes"),        # 9 slabs are not whole 4-slab boxes
    (dict(num_pages=2**26), "2^31"),
])
def test_spec_rejects_what_the_copy_engine_cannot_do(kw, what):
    args = dict(num_pages=4, page_size=64, dk=DK, box_cols=64, box_rows=32, box_slabs=9) | kw
    with pytest.raises(ValueError, match=re.escape(what)):
        tma.kv_map_spec(**args)


def test_kernel_map_struct_and_box_match_the_host():
    """The kernel's KvTensorMap is CUtensorMap's 16 x u64 (64-byte aligned), and its box is one slab
    of 64 columns: TMA_BOX_COLS, read by the launcher from the config array, is that constant."""
    text = FLASH_SM90.source.read_text()
    assert re.search(r"struct __align__\(64\) KvTensorMap \{\s*unsigned long long opaque\[16\];", text)
    assert tma.MAP_DTYPE.itemsize == tma.MAP_BYTES == 16 * 8
    assert re.search(r"constexpr int TMA_BOX_COLS = 64;", text) and "TMA_BOX_COLS" in FLASH_SM90.config_fields
    assert "TMA_BOX_SLABS" in FLASH_SM90.config_fields
    assert FLASH_SM90.kv_tensor_map


def test_encode_refuses_a_misaligned_address_before_calling_the_driver():
    s = tma.kv_map_spec(4, 64, DK, 64, 32, 9)
    with pytest.raises(tma.TmaUnavailable, match="16-byte aligned"):
        tma.encode(s, 0x1008)


def test_strides_must_be_16_byte_multiples():
    with pytest.raises(ValueError, match="multiples of 16"):
        tma.KvMapSpec((64, 100, 9), (1140, 128), (64, 32, 9))
    with pytest.raises(ValueError, match="disagree"):
        tma.KvMapSpec((64, 100, 9), (1152,), (64, 32, 9))
