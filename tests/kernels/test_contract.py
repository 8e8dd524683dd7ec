"""cuda/kdtr_abi.h and its Python mirror kdtr/kernels/contract.py agree: fields, layout, dims, bugs."""

from __future__ import annotations

import numpy as np
import pytest

from kdtr.kernels import contract as abi, bugs, nvrtc
from kdtr.inputs import presets, problem

HEADER = abi.HEADER.read_text()


def test_struct_fields_match_the_mirror():
    assert abi.parse_header_struct(HEADER) == list(abi.FIELDS)


def test_layout_follows_c_alignment():
    offsets, size = abi.c_layout(abi.parse_header_struct(HEADER))
    names = [n for n, _ in abi.FIELDS]
    assert list(abi.PARAMS_DTYPE.names) == names
    assert [abi.PARAMS_DTYPE.fields[n][1] for n in names] == offsets
    assert abi.PARAMS_DTYPE.itemsize == size == 104
    assert abi.PARAMS_DTYPE.itemsize % 8 == 0
    for name, ctype in abi.FIELDS:
        want = np.dtype(np.uint64) if ctype.endswith("*") else np.dtype(abi.CTYPE_NUMPY[ctype])
        assert abi.PARAMS_DTYPE.fields[name][0] == want, name


def test_dimensions_match_presets_and_bugs():
    d = abi.parse_header_defines(HEADER)
    assert (d["KDTR_DK"], d["KDTR_DV"], d["KDTR_DROPE"]) == (presets.DK, presets.DV, presets.DROPE)
    assert d["KDTR_BUG_TILE"] == bugs.TILE
    assert d["KDTR_MASK_BITS"] == problem.MASK_BITS


def test_bug_enum_matches_bugs_module():
    assert abi.parse_header_enum(HEADER, "KdtrBug") == {f"KDTR_BUG_{b.name}": int(b) for b in bugs.Bug}


def test_pack_params_round_trip():
    vals = {n: (i + 1) * 4096 if c.endswith("*") else i for i, (n, c) in enumerate(abi.FIELDS)}
    vals["scale"] = 0.1352
    rec = abi.pack_params(**vals)
    assert isinstance(rec, np.void) and rec.dtype == abi.PARAMS_DTYPE
    for n, v in vals.items():
        assert rec[n] == (np.float32(v) if n == "scale" else v)
    arg = abi.as_kernel_arg(rec)
    assert arg.shape == (1,) and arg.tobytes() == rec.tobytes()
    with pytest.raises(TypeError, match="missing"):
        abi.pack_params(q=0)
    with pytest.raises(ValueError):
        abi.pack_params(**{**vals, "T": 2**31})


def test_parse_header_struct_normalises_spacing():
    text = "struct S {\n  const  void *a;  // c\n  float*b;\n  unsigned int_like;\n};"
    assert abi.parse_header_struct(text, "S") == [("a", "const void*"), ("b", "float*"), ("int_like", "unsigned")]


@pytest.mark.nvrtc
def test_device_compiler_agrees_with_the_numpy_layout():
    """static_asserts on sizeof / offsetof, compiled by NVRTC: the device ABI is the numpy one."""
    checks = [f"static_assert(sizeof(KdtrParams) == {abi.PARAMS_DTYPE.itemsize}, \"size\");"]
    checks += ["static_assert(alignof(KdtrParams) == 8, \"align\");"]
    for name, _ in abi.FIELDS:
        off = abi.PARAMS_DTYPE.fields[name][1]
        checks.append(f"static_assert(__builtin_offsetof(KdtrParams, {name}) == {off}, \"{name}\");")
    ws = abi.workspace_bytes(2, 33, 16, 4)
    checks.append(f"static_assert(KDTR_WORKSPACE_BYTES(2, 33, 16, 4) == {ws}LL, \"workspace\");")
    src = '#include "kdtr_abi.h"\n' + "\n".join(checks) + "\n__global__ void k(const KdtrParams p) { p.lse[0] = p.scale; }\n"
    nvrtc.compile_cuda(src, ["k"], "sm_90", name="layout_probe.cu", cache=False)
