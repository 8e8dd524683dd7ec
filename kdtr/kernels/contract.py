"""Python mirror of ``cuda/kdtr_abi.h``: the KdtrParams struct every kernel takes by value.

``PARAMS_DTYPE`` is a numpy structured dtype with C alignment (``align=True``) in the header's
field order, so one record's bytes are exactly the C struct's: cupy passes a one-element numpy
array of it as the kernel argument. ``parse_header_*`` read the header so that a test keeps the
two (and the dimensions and the KdtrBug list) from drifting apart.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

HEADER = Path(__file__).resolve().parents[2] / "cuda" / "kdtr_abi.h"

POISON_F32_BITS = 0x7FA5A5A5
"""Signalling-NaN pattern written into fp32 outputs before a launch; arithmetic never makes it."""
POISON_BF16_BITS = 0x7FA5
"""The bf16 poison; widened to fp32 by a 16-bit shift it reads 0x7FA50000."""

FIELDS: tuple[tuple[str, str], ...] = (
    ("q", "const void*"),
    ("kv_cache", "const void*"),
    ("block_table", "const int*"),
    ("prefix_lens", "const int*"),
    ("tree_mask", "const unsigned*"),
    ("out", "void*"),
    ("lse", "float*"),
    ("workspace", "void*"),
    ("B", "int"),
    ("T", "int"),
    ("H", "int"),
    ("page_size", "int"),
    ("max_pages", "int"),
    ("mask_words", "int"),
    ("num_pages", "int"),
    ("num_splits", "int"),
    ("scale", "float"),
)
"""(field, C type) in declaration order, as kdtr_abi.h spells them."""

CTYPE_NUMPY = {"int": np.int32, "unsigned": np.uint32, "float": np.float32, "long long": np.int64}
"""C scalar types -> numpy; every pointer is a 64-bit device address (uint64)."""
CTYPE_SIZE = {"int": 4, "unsigned": 4, "float": 4, "long long": 8}
POINTER_SIZE = 8
_INT_BITS = {"int": 32, "long long": 64}


def _numpy_type(ctype: str):
    return np.uint64 if ctype.endswith("*") else CTYPE_NUMPY[ctype]


def struct_dtype(fields) -> np.dtype:
    """The numpy structured dtype of a C struct of these (field, C type) pairs, C alignment (align=True)."""
    return np.dtype({"names": [n for n, _ in fields], "formats": [_numpy_type(c) for _, c in fields]}, align=True)


PARAMS_DTYPE = struct_dtype(FIELDS)
"""One KdtrParams record (104 bytes: 8 pointers, 8 ints, a float, padded to 8)."""


def pack_struct(what: str, fields, dtype: np.dtype, values: dict) -> np.void:
    """A record of struct ``what`` from ``values`` (every field required, pointers as ints; ValueError for a
    negative address or an integer out of its type's range)."""
    missing = [n for n, _ in fields if n not in values]
    extra = sorted(set(values) - {n for n, _ in fields})
    if missing or extra:
        raise TypeError(f"{what}: missing {missing}, unknown {extra}")
    rec = np.zeros((), dtype)
    for name, ctype in fields:
        value = values[name]
        if ctype.endswith("*"):
            value = 0 if value is None else int(value)
            if value < 0:
                raise ValueError(f"{what}: {name} is not a device address: {value}")
        elif ctype in _INT_BITS and not -(2 ** (_INT_BITS[ctype] - 1)) <= int(value) < 2 ** (_INT_BITS[ctype] - 1):
            raise ValueError(f"{what}: {name} = {value} does not fit {ctype}")
        rec[name] = value
    return rec[()]


def pack_params(**fields) -> np.void:
    """A KdtrParams record from keyword fields (every field required, pointers as ints)."""
    return pack_struct("pack_params", FIELDS, PARAMS_DTYPE, fields)


def as_kernel_arg(rec: np.void) -> np.ndarray:
    """The record as a one-element array: cupy passes a size-1 numpy array by value (its bytes)."""
    arr = np.zeros(1, rec.dtype)  # padding bytes zero, not garbage
    arr[0] = rec
    return arr


def workspace_bytes(B: int, T: int, H: int, num_splits: int) -> int:
    """KDTR_WORKSPACE_BYTES of the header: user kernels' split-KV scratch (0 without splits)."""
    if num_splits <= 1:
        return 0
    rows = B * T * H
    return num_splits * rows * (512 + 2) * 4 + rows * 4


# ---- reading the header ------------------------------------------------------------------------


def _strip_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def parse_header_struct(text: str, name: str = "KdtrParams") -> list[tuple[str, str]]:
    """[(field, C type)] of ``struct name { ... };`` with the type's spacing normalised."""
    body = re.search(r"struct\s+" + re.escape(name) + r"\s*\{(.*?)\}\s*;", _strip_comments(text), re.S)
    if body is None:
        raise ValueError(f"struct {name} not found")
    fields = []
    for decl in body.group(1).split(";"):
        decl = " ".join(decl.split())
        if not decl:
            continue
        m = re.fullmatch(r"(.*?[\w*])\s*\b(\w+)", decl.replace("*", "* ").replace(" *", "*"))
        if m is None:
            raise ValueError(f"cannot parse field declaration {decl!r}")
        ctype = " ".join(m.group(1).split())
        fields.append((m.group(2), ctype))
    return fields


def parse_header_enum(text: str, name: str = "KdtrBug") -> dict[str, int]:
    """{enumerator: value} of ``enum name { A = 0, ... };`` or ``enum name : int { ... };`` (explicit values required)."""
    body = re.search(r"enum\s+" + re.escape(name) + r"\s*(?::\s*\w+\s*)?\{(.*?)\}\s*;", _strip_comments(text), re.S)
    if body is None:
        raise ValueError(f"enum {name} not found")
    out = {}
    for item in body.group(1).split(","):
        if item.strip():
            key, _, value = item.partition("=")
            out[key.strip()] = int(value.strip(), 0)
    return out


def parse_header_defines(text: str) -> dict[str, int]:
    """Integer ``#define NAME value`` lines."""
    out = {}
    for m in re.finditer(r"^\s*#\s*define\s+(\w+)\s+(-?\d+)\b", _strip_comments(text), re.M):
        out[m.group(1)] = int(m.group(2))
    return out


def c_layout(fields) -> tuple[list[int], int]:
    """(offsets, sizeof) of a C struct of these (field, C type) pairs on a 64-bit target."""
    offsets, pos, align_max = [], 0, 1
    for _, ctype in fields:
        size = POINTER_SIZE if ctype.endswith("*") else CTYPE_SIZE[ctype.replace("const ", "")]
        pos = -(-pos // size) * size  # natural alignment: scalars and pointers align to their size
        offsets.append(pos)
        pos += size
        align_max = max(align_max, size)
    return offsets, -(-pos // align_max) * align_max
