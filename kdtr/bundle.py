"""Golden bundles: one self-checking ``.kdtr`` file per case (format: docs/FORMAT.md).

A bundle is a plain safetensors file, so any safetensors reader (C++, Rust, Python) can open it,
but kdtr reads it with its own small parser: a golden file is trusted to judge kernels, so loading
must prove it intact (per-tensor sha256, shapes, trees) and must never let a corrupt or hostile
header make it allocate or index past the file's real size. Writes are atomic (kdtr.atomic) so
that an interrupted generation never leaves a half-written golden behind.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import struct
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from kdtr import tolerances
from kdtr.atomic import atomic_writer, exclusive_writer
from kdtr.presets import DK, DV
from kdtr.problem import Problem, mask_words

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
MAX_PROBLEM = 400
"""Longest problem text a BundleError carries (a hostile header may hold huge names or values)."""
_CHUNK = 1 << 20


class BundleError(Exception):
    """Any problem loading a bundle; the message is one line: "{path}: {problem}".

    ``BundleError(message)`` (no problem) takes an already formatted message as is.
    """

    def __init__(self, path, problem: str | None = None):
        self.path = os.fspath(path) if problem is not None else None
        text = " ".join(str(path if problem is None else problem).split())
        self.problem = text if len(text) <= MAX_PROBLEM else text[: MAX_PROBLEM - 3] + "..."
        super().__init__(self.problem if self.path is None else f"{self.path}: {self.problem}")

    def __reduce__(self):
        return (type(self), (self.problem,) if self.path is None else (self.path, self.problem))


class _Invalid(ValueError):
    """A validation failure with a clean, user-facing problem text."""


@dataclass
class Bundle:
    """A loaded golden: the inputs, the reference outputs and the metadata."""

    path: str | None
    """Where it was loaded from (None when built in memory)."""
    problem: Problem
    """The operator inputs, exactly as stored."""
    out: np.ndarray
    """[B, T, H, 512] reference output: the float64 reference rounded to nearest float32."""
    lse: np.ndarray
    """[B, T, H] float64 reference log-sum-exp (natural log)."""
    draft_logp: np.ndarray | None
    """[B, L, K] float64 drafter log-probs the DDTree trees were built from, or None."""
    meta: dict
    """The full ``kdtr`` metadata object, unknown keys included."""

    @property
    def name(self) -> str:
        return self.meta["case"]

    @property
    def out_dtype(self) -> str:
        return self.meta["out_dtype"]

    @property
    def kv_dtype(self) -> str:
        return self.meta["kv_dtype"]

    @property
    def tolerances(self) -> dict:
        return self.meta["tolerances"]

    @property
    def tree_family(self) -> str:
        return self.meta["tree"]["family"]


def _dtype_code(name: str, a: np.ndarray) -> str:
    for code, dt in DTYPES.items():
        if a.dtype == dt:
            return code
    raise _Invalid(f"tensor {name!r}: unsupported dtype {a.dtype}")


def _raw(a: np.ndarray) -> memoryview:
    """The array's bytes in C order (little endian: DTYPES are all '<' or byte-free)."""
    return memoryview(np.ascontiguousarray(a).reshape(-1).view(np.uint8))


def tensor_sha256(a: np.ndarray) -> str:
    """sha256 hex of a tensor's raw little-endian bytes, as stored in ``checksums``."""
    return hashlib.sha256(_raw(a)).hexdigest()


def _dumps(obj) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False, ensure_ascii=True)


def metadata_strings(meta_text: str) -> dict[str, str]:
    """The safetensors ``__metadata__`` map for a serialised kdtr metadata object."""
    return {META_KEY: meta_text, META_SHA_KEY: hashlib.sha256(meta_text.encode("utf-8")).hexdigest()}


def _encode_header(tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> bytes:
    """8-byte length + JSON header, space-padded so the data starts 8-byte aligned."""
    header: dict = {"__metadata__": metadata}
    pos = 0
    for name, a in tensors.items():
        n = a.nbytes
        header[name] = {"dtype": _dtype_code(name, a), "shape": list(a.shape), "data_offsets": [pos, pos + n]}
        pos += n
    text = _dumps(header).encode()
    text += b" " * (-(8 + len(text)) % 8)
    return struct.pack("<Q", len(text)) + text


def save_bundle(path, problem: Problem, out, lse, meta: dict, draft_logp=None, atomic: bool = True) -> str:
    """Validate, then atomically write a bundle; returns the sha256 of the whole file.

    atomic=False writes ``path`` itself, which must not exist yet: for a caller that stages the
    file under a temporary name (temp_path) and renames it into place later (publish).
    """
    problem.validate()
    tensors = {"out": out, "lse": lse, "draft_logp": draft_logp}
    tensors.update({n: getattr(problem, n) for n in TENSOR_ORDER[3:]})
    tensors = {n: np.asarray(tensors[n]) for n in TENSOR_ORDER if tensors[n] is not None}
    for n in ("lse", "draft_logp"):  # float32 -> float64 is exact; the format stores these as F64
        if n in tensors and tensors[n].dtype.kind == "f":
            tensors[n] = tensors[n].astype(np.float64, copy=False)
    if tensors["out"].dtype != np.float32:  # out: the float64 reference rounded to nearest fp32
        tensors["out"] = tensors["out"].astype(np.float32)
    (pages, page_size, _), max_pages = problem.kv_cache.shape, problem.block_table.shape[1]
    dims = dict(meta.get("dims") or {})  # extra keys a caller put in dims are kept
    dims.update(B=problem.B, T=problem.T, H=problem.H, Dk=DK, Dv=DV, page_size=page_size,
                num_pages=pages, max_pages=max_pages)
    full = dict(meta, format=FORMAT, version=VERSION, scale=float(problem.scale), dims=dims,
                kv_dtype=problem.kv_dtype, checksums={n: tensor_sha256(a) for n, a in tensors.items()})
    _check_all({n: (_dtype_code(n, a), list(a.shape)) for n, a in tensors.items()}, full)
    _check_data(_make_problem(tensors, full))
    head = _encode_header(tensors, metadata_strings(_dumps(full)))
    digest = hashlib.sha256(head)
    with (atomic_writer if atomic else exclusive_writer)(path) as f:
        f.write(head)
        for a in tensors.values():
            raw = _raw(a)
            digest.update(raw)
            f.write(raw)
    return digest.hexdigest()


def _read_header(f, size: int) -> tuple[dict, int]:
    """Parse the length field and JSON header; returns (header, data start)."""
    if size < 8:
        raise _Invalid(f"truncated: the file is {size} bytes, shorter than the 8-byte header length")
    (n,) = struct.unpack("<Q", f.read(8))
    if n > size - 8:
        raise _Invalid(f"truncated or not a kdtr bundle: header length field claims {n} bytes, {size - 8} follow")
    limit = header_limit(size - 8 - n)
    if n > limit:
        raise _Invalid(f"not a kdtr bundle or corrupt: a {n}-byte header with {size - 8 - n} data bytes "
                       f"(a kdtr header is at most {limit} bytes with that much data)")
    try:
        header = json.loads(f.read(n).decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise _Invalid(f"header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise _Invalid("not a kdtr bundle (the safetensors header is not a JSON object)")
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
                raise _Invalid(f"repeated key {k!r}")
            seen.add(k)
    return out


def _parse_meta(header: dict) -> dict:
    """The ``kdtr`` metadata object, after the format and version checks."""
    md = header.get("__metadata__")
    if not isinstance(md, dict) or not isinstance(md.get(META_KEY), str):
        raise _Invalid(f"not a kdtr bundle (no {META_KEY!r} metadata string)")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in md.items()):
        raise _Invalid("__metadata__ must map strings to strings")
    want = md.get(META_SHA_KEY)  # absent in bundles written before kdtr recorded it
    if want is not None and hashlib.sha256(md[META_KEY].encode("utf-8", "surrogatepass")).hexdigest() != want:
        raise _Invalid("metadata checksum mismatch (the header is corrupt: regenerate it)")
    try:
        meta = json.loads(md[META_KEY], object_pairs_hook=_no_duplicates)
    except (ValueError, RecursionError) as e:
        raise _Invalid(f"{META_KEY!r} metadata is not valid JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        fmt = meta.get("format") if isinstance(meta, dict) else None
        raise _Invalid(f"not a kdtr bundle (format is {fmt!r}, expected {FORMAT!r})")
    v = meta.get("version")
    if not _is_int(v) or v != VERSION:
        raise _Invalid(f"unsupported bundle version {v!r} (this kdtr reads version {VERSION}: regenerate or upgrade)")
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
            raise _Invalid(f"tensor {name!r}: header entry needs dtype, shape and data_offsets")
        code, shape, offs = e["dtype"], e["shape"], e["data_offsets"]
        if not isinstance(code, str) or code not in DTYPES:
            raise _Invalid(f"tensor {name!r}: unsupported dtype {code!r} (supported: {', '.join(DTYPES)})")
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise _Invalid(f"tensor {name!r}: shape must be a list of non-negative integers")
        if not (isinstance(offs, list) and len(offs) == 2 and all(_is_int(o) and o >= 0 for o in offs)):
            raise _Invalid(f"tensor {name!r}: data_offsets must be two non-negative integers")
        begin, end = offs
        if end > data_len:
            raise _Invalid(f"truncated: tensor {name!r} ends at data byte {end} of {data_len}")
        need = _nbytes(shape, DTYPES[code].itemsize, data_len)
        if end - begin != need:
            shown = need if need <= data_len else f"more than the {data_len} data bytes"
            raise _Invalid(f"tensor {name!r}: data_offsets span {end - begin} bytes but {code}{_show(shape)} needs {shown}")
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
            raise _Invalid(f"tensors {prev!r} and {name!r} overlap in the data region")
        if begin > pos:
            raise _Invalid(f"{begin - pos} data bytes before tensor {name!r} belong to no tensor")
        pos, prev = end, name
    if pos != data_len:
        raise _Invalid(f"{data_len - pos} trailing bytes after the last tensor")


def _check_all(entries: dict[str, tuple], meta: dict) -> None:
    """Metadata schema, dtypes and shapes agree with each other and with ``dims``."""
    _check_meta(meta)
    missing = [n for n in REQUIRED if n not in entries]
    if missing:
        raise _Invalid(f"missing required tensor {missing[0]!r}")
    kv = entries["q"][0]
    if kv not in KV_CODES or entries["kv_cache"][0] != kv:
        raise _Invalid(f"q is {kv} and kv_cache is {entries['kv_cache'][0]}: both must be F32 or BF16")
    if KV_CODES[kv] != meta["kv_dtype"]:
        raise _Invalid(f"metadata kv_dtype {meta['kv_dtype']!r} but q/kv_cache are {kv}")
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
            raise _Invalid(f"tensor {name!r} has dtype {code}, expected {want_code}")
        if len(shape) != len(want) or any(w != s for w, s in zip(want, shape) if not isinstance(w, str)):
            raise _Invalid(f"tensor {name!r} has shape {shape}, expected {_show(want)} from dims")
    if set(meta["checksums"]) != set(entries):
        raise _Invalid(f"checksums name {sorted(meta['checksums'])} but the tensors are {sorted(entries)}")


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
        raise _Invalid(f"metadata lacks {', '.join(missing)}")
    d = meta["dims"]
    if not isinstance(d, dict) or not all(_is_int(d.get(k)) and d[k] >= 1 for k in DIM_KEYS):
        raise _Invalid(f"metadata dims must give positive integers {', '.join(DIM_KEYS)}")
    if d["Dk"] != DK or d["Dv"] != DV:
        raise _Invalid(f"dims Dk={d['Dk']}, Dv={d['Dv']}: only Dk={DK}, Dv={DV} are supported")
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
            raise _Invalid(f"metadata {key} must be {what}, got {meta[key]!r}")
    if why := tolerances.recorded_problem(meta["tolerances"]):
        raise _Invalid(f"metadata tolerances {why}")


def _make_problem(arrays: dict[str, np.ndarray], meta: dict) -> Problem:
    fields = {n: arrays[n] for n in TENSOR_ORDER[3:]}
    return Problem(scale=float(meta["scale"]), **fields)


def _check_data(problem: Problem) -> None:
    """Problem.validate() plus kdtr.trees.check_tree per request (ValueError -> _Invalid)."""
    from kdtr import trees

    try:
        problem.validate()
    except ValueError as e:
        raise _Invalid(f"inconsistent inputs: {e}") from None
    for b in range(problem.B):
        try:
            trees.check_tree(problem.tree_parent[b], problem.tree_depth[b], problem.tree_mask[b])
        except ValueError as e:
            raise _Invalid(f"request {b}: bad tree: {e}") from None


def _check_draft(draft, problem: Problem, family) -> None:
    """In a DDTree bundle, draft_logp [B, L, K] must rebuild each request's tree (SPEC section 2):
    bytes that pass their checksum under a transposed shape, or values edited under re-signed
    metadata, describe another draft. Other families carry draft_logp as opaque data."""
    from kdtr import trees

    if draft is None or family != "ddtree":
        return
    for b in range(problem.B):
        try:
            parent = trees.ddtree(draft[b], problem.T - 1).parent
        except trees.TreeError as e:
            raise _Invalid(f"request {b}: draft_logp is no DDTree draft: {e}") from None
        if not np.array_equal(parent, problem.tree_parent[b]):
            raise _Invalid(f"request {b}: draft_logp does not rebuild tree_parent (DDTree's best-first order)")


_BAD_INPUT = (ValueError, TypeError, KeyError, IndexError, AttributeError, ArithmeticError,
              struct.error, MemoryError, RecursionError)


@contextlib.contextmanager
def _reporting(path):
    """Turn every failure while reading ``path`` into one BundleError."""
    try:
        yield
    except BundleError:
        raise
    except _Invalid as e:
        raise BundleError(path, str(e)) from None
    except FileNotFoundError:
        raise BundleError(path, "file not found") from None
    except OSError as e:
        raise BundleError(path, f"cannot read the file ({e.strerror or e})") from None
    except _BAD_INPUT as e:
        raise BundleError(path, f"malformed bundle ({type(e).__name__}: {e})") from None


def _read_checked_header(f) -> tuple[dict, dict, int]:
    """(meta, entries, data length) after every check that needs no tensor data."""
    size = os.fstat(f.fileno()).st_size
    header, start = _read_header(f, size)
    meta = _parse_meta(header)
    entries = _parse_entries(header, size - start)
    _check_all(entries, meta)
    return meta, entries, size - start


def read_meta(path) -> dict:
    """The ``kdtr`` metadata after all header-level checks, without reading the tensor data."""
    with _reporting(path), open(path, "rb") as f:
        return _read_checked_header(f)[0]


def load_bundle(path, verify_checksums: bool = True) -> Bundle:
    """Read and fully validate a bundle; raises BundleError on any problem."""
    with _reporting(path), open(path, "rb") as f:
        meta, entries, data_len = _read_checked_header(f)
        buf = bytearray(data_len)  # bounded by the real file size, never by header claims
        if f.readinto(buf) != len(buf):
            raise _Invalid("truncated: the file shrank while being read")
        view = memoryview(buf)
        arrays = {}
        for name, (code, shape, begin, end) in entries.items():
            if verify_checksums and hashlib.sha256(view[begin:end]).hexdigest() != meta["checksums"][name]:
                raise _Invalid(f"checksum mismatch in tensor {name!r} (the file is corrupt: regenerate it)")
            count = math.prod(shape)
            arrays[name] = np.frombuffer(buf, DTYPES[code], count, begin).reshape(shape)
        problem = _make_problem(arrays, meta)
        _check_data(problem)
        _check_draft(arrays.get("draft_logp"), problem, meta["tree"].get("family"))
        return Bundle(os.fspath(path), problem, arrays["out"], arrays["lse"], arrays.get("draft_logp"), meta)


def file_sha256(path) -> str:
    """sha256 hex of the whole file (what manifests record)."""
    digest = hashlib.sha256()
    with _reporting(path), open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()
