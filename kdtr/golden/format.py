"""The ``.kdtr`` header: its constants, and every check that needs no tensor data (format:
docs/FORMAT.md).

Split from kdtr.golden.bundle so that the part a hostile file meets first reads on its own: lengths and
offsets are checked against the real file size before anything is allocated or indexed, the
metadata schema and the tensor table against each other. Failures raise ``Invalid`` with a
one-line problem text; kdtr.bundle turns it into a BundleError naming the file.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct

import ml_dtypes
import numpy as np

from kdtr.golden import tolerances
from kdtr.inputs.presets import DK, DV
from kdtr.inputs.problem import mask_words

FORMAT = "kdtr-bundle"
VERSION = 1
META_KEY = "kdtr"
META_SHA_KEY = "kdtr_sha256"
"""__metadata__ key of the sha256 of the metadata string: the tensors have checksums, and so does
the metadata (scale, tolerances...), so that no flipped bit anywhere in a bundle goes unnoticed."""
DTYPES = {"F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "BF16": np.dtype(ml_dtypes.bfloat16),
          "I32": np.dtype("<i4"), "U32": np.dtype("<u4")}
"""safetensors dtype code -> numpy dtype (all little endian)."""
KV_CODES = {"F32": "fp32", "BF16": "bf16"}
"""Storage dtype codes of q / kv_cache and their kdtr names."""
TENSOR_ORDER = ("lse", "draft_logp", "out", "q", "kv_cache",
                "block_table", "prefix_lens", "tree_parent", "tree_depth", "tree_mask")
"""Order of the data buffer: 8-byte types first, so every tensor starts aligned to its item."""
REQUIRED = tuple(n for n in TENSOR_ORDER if n != "draft_logp")
CALLER_KEYS = ("case", "out_dtype", "tree", "seed", "tolerances", "generator", "spec")
"""Metadata keys save_bundle needs from its caller; it fills in the rest."""
DIM_KEYS = ("B", "T", "H", "Dk", "Dv", "page_size", "num_pages", "max_pages")
HEADER_BASE = 16 << 10
HEADER_DATA_RATIO = 64
"""Header size limit: HEADER_BASE bytes plus one byte per HEADER_DATA_RATIO data bytes (header_limit)."""


class Invalid(ValueError):
    """A validation failure with a clean, user-facing problem text."""


def _read_header(f, size: int) -> tuple[dict, int]:
    """Parse the length field and JSON header; returns (header, data start)."""
    if size < 8:
        raise Invalid(f"truncated: the file is {size} bytes, shorter than the 8-byte header length")
    (n,) = struct.unpack("<Q", f.read(8))
    if n > size - 8:
        raise Invalid(f"truncated or not a kdtr bundle: header length field claims {n} bytes, {size - 8} follow")
    limit = header_limit(size - 8 - n)
    if n > limit:
        raise Invalid(f"not a kdtr bundle or corrupt: a {n}-byte header with {size - 8 - n} data bytes "
                       f"(a kdtr header is at most {limit} bytes with that much data)")
    try:
        header = json.loads(f.read(n).decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise Invalid(f"header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise Invalid("not a kdtr bundle (the safetensors header is not a JSON object)")
    return header, 8 + n


def header_limit(data_len: int) -> int:
    """Largest header kdtr accepts in front of ``data_len`` data bytes.

    A parsed JSON object costs up to ~30x its text in Python objects, so an unbounded header
    would let a small hostile file allocate far more than its size. Real headers are about
    2.5 KB plus a few bytes per request, and every request brings kilobytes of data.
    """
    return HEADER_BASE + data_len // HEADER_DATA_RATIO


def _no_duplicates(pairs: list) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):  # find the first repeat in one pass (hostile headers have many keys)
        seen = set()
        for k, _ in pairs:
            if k in seen:
                raise Invalid(f"repeated key {k!r}")
            seen.add(k)
    return out


def _parse_meta(header: dict) -> dict:
    """The ``kdtr`` metadata object, after the format and version checks."""
    md = header.get("__metadata__")
    if not isinstance(md, dict) or not isinstance(md.get(META_KEY), str):
        raise Invalid(f"not a kdtr bundle (no {META_KEY!r} metadata string)")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in md.items()):
        raise Invalid("__metadata__ must map strings to strings")
    want = md.get(META_SHA_KEY)  # absent in bundles written before kdtr recorded it
    if want is not None and hashlib.sha256(md[META_KEY].encode("utf-8", "surrogatepass")).hexdigest() != want:
        raise Invalid("metadata checksum mismatch (the header is corrupt: regenerate it)")
    try:
        meta = json.loads(md[META_KEY], object_pairs_hook=_no_duplicates)
    except (ValueError, RecursionError) as e:
        raise Invalid(f"{META_KEY!r} metadata is not valid JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        fmt = meta.get("format") if isinstance(meta, dict) else None
        raise Invalid(f"not a kdtr bundle (format is {fmt!r}, expected {FORMAT!r})")
    v = meta.get("version")
    if not _is_int(v) or v != VERSION:
        raise Invalid(f"unsupported bundle version {v!r} (this kdtr reads version {VERSION}: regenerate or upgrade)")
    return meta


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _parse_entries(header: dict, data_len: int) -> dict[str, tuple[str, list, int, int]]:
    """Tensor name -> (dtype code, shape, begin, end), checked against the real data length."""
    entries = {}
    for name, e in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(e, dict) or not {"dtype", "shape", "data_offsets"} <= e.keys():
            raise Invalid(f"tensor {name!r}: header entry needs dtype, shape and data_offsets")
        code, shape, offs = e["dtype"], e["shape"], e["data_offsets"]
        if not isinstance(code, str) or code not in DTYPES:
            raise Invalid(f"tensor {name!r}: unsupported dtype {code!r} (supported: {', '.join(DTYPES)})")
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise Invalid(f"tensor {name!r}: shape must be a list of non-negative integers")
        if not (isinstance(offs, list) and len(offs) == 2 and all(_is_int(o) and o >= 0 for o in offs)):
            raise Invalid(f"tensor {name!r}: data_offsets must be two non-negative integers")
        begin, end = offs
        if end > data_len:
            raise Invalid(f"truncated: tensor {name!r} ends at data byte {end} of {data_len}")
        need = _nbytes(shape, DTYPES[code].itemsize, data_len)
        if end - begin != need:
            shown = need if need <= data_len else f"more than the {data_len} data bytes"
            raise Invalid(f"tensor {name!r}: data_offsets span {end - begin} bytes but {code}{_show(shape)} needs {shown}")
        entries[name] = (code, shape, begin, end)
    _check_tiling(entries, data_len)
    return entries


def _nbytes(shape: list, itemsize: int, cap: int) -> int:
    """Exact byte size of a tensor, or some number above ``cap`` as soon as it must exceed it.

    Stops early so that a hostile shape of many huge dims costs no big-integer arithmetic.
    """
    if 0 in shape:
        return 0
    n = itemsize
    for d in shape:
        n *= d
        if n > cap:
            return n
    return n


def _check_tiling(entries: dict, data_len: int) -> None:
    """The tensors must tile the data region: no overlap, no gap, no trailing bytes."""
    pos, prev = 0, None
    for name, (_, _, begin, end) in sorted(entries.items(), key=lambda kv: (kv[1][2], kv[1][3])):
        if begin < pos:
            raise Invalid(f"tensors {prev!r} and {name!r} overlap in the data region")
        if begin > pos:
            raise Invalid(f"{begin - pos} data bytes before tensor {name!r} belong to no tensor")
        pos, prev = end, name
    if pos != data_len:
        raise Invalid(f"{data_len - pos} trailing bytes after the last tensor")


def _check_all(entries: dict[str, tuple], meta: dict) -> None:
    """Metadata schema, dtypes and shapes agree with each other and with ``dims``."""
    _check_meta(meta)
    missing = [n for n in REQUIRED if n not in entries]
    if missing:
        raise Invalid(f"missing required tensor {missing[0]!r}")
    kv = entries["q"][0]
    if kv not in KV_CODES or entries["kv_cache"][0] != kv:
        raise Invalid(f"q is {kv} and kv_cache is {entries['kv_cache'][0]}: both must be F32 or BF16")
    if KV_CODES[kv] != meta["kv_dtype"]:
        raise Invalid(f"metadata kv_dtype {meta['kv_dtype']!r} but q/kv_cache are {kv}")
    d = meta["dims"]
    B, T, H = d["B"], d["T"], d["H"]
    expect = {  # name -> (dtype code, shape); "L" and "K" match any size
        "q": (kv, [B, T, H, DK]), "kv_cache": (kv, [d["num_pages"], d["page_size"], DK]),
        "block_table": ("I32", [B, d["max_pages"]]), "prefix_lens": ("I32", [B]),
        "tree_parent": ("I32", [B, T]), "tree_depth": ("I32", [B, T]), "tree_mask": ("U32", [B, T, mask_words(T)]),
        "out": ("F32", [B, T, H, DV]), "lse": ("F64", [B, T, H]), "draft_logp": ("F64", [B, "L", "K"]),
    }
    for name, (want_code, want) in expect.items():
        code, shape = entries.get(name, (want_code, want))[:2]
        if code != want_code:
            raise Invalid(f"tensor {name!r} has dtype {code}, expected {want_code}")
        if len(shape) != len(want) or any(w != s for w, s in zip(want, shape) if not isinstance(w, str)):
            raise Invalid(f"tensor {name!r} has shape {shape}, expected {_show(want)} from dims")
    if set(meta["checksums"]) != set(entries):
        raise Invalid(f"checksums name {sorted(meta['checksums'])} but the tensors are {sorted(entries)}")


def _show(shape: list) -> str:
    """'[2, 5, 576]'; a hostile many-dim shape as '[9, 9, 9, 9, ... (500 dims)]'."""
    if len(shape) > 8:
        return "[" + ", ".join(str(d) for d in shape[:4]) + f", ... ({len(shape)} dims)]"
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _check_meta(meta: dict) -> None:
    """Types of the metadata fields kdtr itself relies on."""
    need = CALLER_KEYS + ("format", "version", "dims", "scale", "kv_dtype", "checksums")
    missing = [k for k in need if k not in meta]
    if missing:
        raise Invalid(f"metadata lacks {', '.join(missing)}")
    d = meta["dims"]
    if not isinstance(d, dict) or not all(_is_int(d.get(k)) and d[k] >= 1 for k in DIM_KEYS):
        raise Invalid(f"metadata dims must give positive integers {', '.join(DIM_KEYS)}")
    if d["Dk"] != DK or d["Dv"] != DV:
        raise Invalid(f"dims Dk={d['Dk']}, Dv={d['Dv']}: only Dk={DK}, Dv={DV} are supported")
    s, tree = meta["scale"], meta["tree"]
    rules = {
        "scale": (type(s) in (int, float) and math.isfinite(s) and s > 0, "a positive finite number"),
        "kv_dtype": (meta["kv_dtype"] in ("fp32", "bf16"), "'fp32' or 'bf16'"),
        "out_dtype": (meta["out_dtype"] in ("fp32", "bf16"), "'fp32' or 'bf16'"),
        "tree": (isinstance(tree, dict) and isinstance(tree.get("family"), str), "an object with a string 'family'"),
        "seed": (_is_int(meta["seed"]), "an integer"),
        **{k: (isinstance(meta[k], str), "a JSON string") for k in ("case", "generator")},
        **{k: (isinstance(meta[k], dict), "a JSON object") for k in ("tolerances", "spec", "checksums")},
    }
    for key, (ok, what) in rules.items():
        if not ok:
            raise Invalid(f"metadata {key} must be {what}, got {meta[key]!r}")
    if why := tolerances.recorded_problem(meta["tolerances"]):
        raise Invalid(f"metadata tolerances {why}")
    if why := tolerances.recorded_conditioning_problem(meta.get("conditioning")):  # optional: older bundles lack it
        raise Invalid(f"metadata conditioning {why}")


def read_checked_header(f) -> tuple[dict, dict, int]:
    """(meta, entries, data length) after every check that needs no tensor data."""
    size = os.fstat(f.fileno()).st_size
    header, start = _read_header(f, size)
    meta = _parse_meta(header)
    entries = _parse_entries(header, size - start)
    _check_all(entries, meta)
    return meta, entries, size - start
