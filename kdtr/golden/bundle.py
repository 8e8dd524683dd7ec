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
from functools import cached_property

import numpy as np

from kdtr.golden.atomic import atomic_writer, exclusive_writer
from kdtr.golden.format import DTYPES, FORMAT, META_KEY, META_SHA_KEY, TENSOR_ORDER, VERSION, _check_all, read_checked_header
from kdtr.golden.format import Invalid as _Invalid
from kdtr.inputs.presets import DK, DV
from kdtr.inputs.problem import Problem

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
    def conditioning(self) -> dict | None:
        """{"max_abs_score": x} as recorded at generation (validated on load), or None in older bundles."""
        return self.meta.get("conditioning")

    @cached_property
    def bounds_conditioning(self):
        """What this case's bounds scale with (kdtr.golden.tolerances.Conditioning): the recorded max |s|, capped
        by the stored data's Cauchy-Schwarz bound. Computed once per bundle: a pass over every request's keys,
        which verify --graph would otherwise repeat for each capture it judges."""
        from kdtr.golden.reference import score_bounds
        from kdtr.golden.tolerances import conditioning

        return conditioning(self.conditioning, *score_bounds(self.problem))

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


def _make_problem(arrays: dict[str, np.ndarray], meta: dict) -> Problem:
    fields = {n: arrays[n] for n in TENSOR_ORDER[3:]}
    return Problem(scale=float(meta["scale"]), **fields)


def _check_data(problem: Problem) -> None:
    """Problem.validate() plus kdtr.trees.check_tree per request (ValueError -> _Invalid)."""
    from kdtr.inputs import trees

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
    from kdtr.inputs import trees

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


def read_meta(path) -> dict:
    """The ``kdtr`` metadata after all header-level checks, without reading the tensor data."""
    with _reporting(path), open(path, "rb") as f:
        return read_checked_header(f)[0]


def load_bundle(path, verify_checksums: bool = True) -> Bundle:
    """Read and fully validate a bundle; raises BundleError on any problem."""
    with _reporting(path), open(path, "rb") as f:
        meta, entries, data_len = read_checked_header(f)
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
