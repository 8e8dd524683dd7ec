"""Compile CUDA C++ to a cubin with NVRTC through ctypes: any arch, no GPU, no cupy.

The pip wheels ``nvidia-cuda-nvrtc`` (the compiler) and ``nvidia-cuda-runtime`` (headers such as
``cuda_bf16.h``) are all it needs, so CI compiles every kernel for sm_80 / sm_90 / sm_120 on a
machine without a GPU. Cubins are cached on disk keyed by everything that can change them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import hashlib
import importlib.util
import json
import os
import re
import tempfile
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

LINEINFO_ENV = "KDTR_LINEINFO"
"""Set to 1 to compile every kernel with -lineinfo (kdtr verify --sanitize does, so reports name source lines)."""


def find_cuda_dir(env: str | None = None, tree: Path | None = None, prefixes=None) -> Path:
    """kdtr's CUDA sources: $KDTR_CUDA_DIR, else the source tree's cuda/ (a checkout or an editable
    install), else the copy a wheel installs as <prefix>/share/kdtr/cuda (venv, system or user)."""
    if env:
        return Path(env)
    tree = tree or Path(__file__).resolve().parents[2] / "cuda"
    if tree.is_dir():
        return tree
    if prefixes is None:
        import site
        import sys

        prefixes = [sys.prefix, sys.base_prefix, site.getuserbase()]
    for prefix in prefixes:
        installed = Path(prefix) / "share" / "kdtr" / "cuda"
        if installed.is_dir():
            return installed
    return tree  # nowhere: a compile then names the path it looked in


CUDA_DIR = find_cuda_dir(os.environ.get("KDTR_CUDA_DIR"))
"""kdtr's CUDA sources and headers (kdtr_abi.h, kdtr_common.cuh, the built-in kernels)."""
DEFAULT_OPTIONS = ("-std=c++17",)
_INSTALL_HINT = (
    "pip install 'nvidia-cuda-nvrtc>=13,<14' 'nvidia-cuda-runtime>=13,<14' (or kdtr[nvrtc]; "
    "for a CUDA 12 driver: nvidia-cuda-nvrtc-cu12 nvidia-cuda-runtime-cu12), or set CUDA_PATH"
)


class NvrtcUnavailable(RuntimeError):
    """No usable libnvrtc (or no CUDA headers) was found."""


class CompileError(Exception):
    """NVRTC rejected the source; ``str()`` is the compiler's own log (error lines first)."""

    def __init__(self, log: str, name: str = "kernel.cu", arch: str = ""):
        self.log = log
        self.errors = [ln for ln in log.splitlines() if re.search(r"\berror\b", ln, re.I)]
        lines = self.errors or [ln for ln in log.splitlines() if ln.strip()] or ["(empty compiler log)"]
        head = f"{name}: NVRTC compile failed" + (f" for {arch}" if arch else "")
        super().__init__(head + "\n" + "\n".join(lines))


@dataclass(frozen=True)
class Resources:
    """ptxas's ``-v`` report for one kernel (an entry function) of a cubin."""

    registers: int = 0
    """Registers per thread."""
    shared_bytes: int = 0
    """Static shared memory (dynamic shared memory is a launch parameter, not in here)."""
    stack_frame: int = 0
    """Stack frame per thread, bytes (local arrays, calls, spills)."""
    spill_stores: int = 0
    """Bytes stored to local memory because registers ran out."""
    spill_loads: int = 0
    """Bytes loaded back from those spills."""
    barriers: int = 0
    """Named barriers the kernel uses."""


@dataclass
class Compiled:
    """One NVRTC compilation: the cubin and what the compiler said about it."""

    cubin: bytes
    lowered: dict[str, str]
    """name expression -> mangled name to pass to cuModuleGetFunction / RawModule.get_function."""
    log: str
    warnings: list[str]
    resources: dict[str, Resources]
    """mangled name -> ptxas resource report (every entry function in the cubin)."""
    arch: str
    options: tuple[str, ...]
    key: str
    path: Path | None = None
    """The cached cubin on disk (load it with cupy.RawModule(path=...))."""
    from_cache: bool = False

    def resource(self, name_expression: str) -> Resources:
        return self.resources[self.lowered[name_expression]]


# ---- finding the library and the headers ---------------------------------------------------------


def _nvidia_roots() -> list[Path]:
    """site-packages/nvidia directories (a namespace package spread over sys.path)."""
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        return []
    return [Path(p) for p in (spec.submodule_search_locations or [])] if spec else []


def _candidates() -> list[tuple[Path | str, Path | None]]:
    """(library path or name, include dir) pairs, most specific first."""
    out: list[tuple[Path | str, Path | None]] = []
    for root in _nvidia_roots():
        for sub, inc, pat in (("cu13", "cu13", "libnvrtc.so.1*"), ("cuda_nvrtc", "cuda_runtime", "libnvrtc.so.1*")):
            for lib in sorted(glob.glob(str(root / sub / "lib" / pat))):
                if "builtins" not in lib and "alt" not in Path(lib).name:
                    out.append((Path(lib), root / inc / "include"))
            for dll in sorted(glob.glob(str(root / sub / "bin" / "nvrtc64_*.dll"))):
                out.append((Path(dll), root / inc / "include"))
    for env in ("CUDA_PATH", "CUDA_HOME"):
        if os.environ.get(env):
            base = Path(os.environ[env])
            for lib in sorted(glob.glob(str(base / "lib64" / "libnvrtc.so*"))) + sorted(
                glob.glob(str(base / "bin" / "nvrtc64_*.dll"))
            ):
                out.append((Path(lib), base / "include"))
    name = ctypes.util.find_library("nvrtc")
    for lib in ([name] if name else []) + ["libnvrtc.so"]:
        out.append((lib, Path("/usr/local/cuda/include")))
    return out


def _has_headers(include: Path | None) -> bool:
    """Does this include dir hold the CUDA headers the kernels need (cuda_bf16.h)?"""
    return include is not None and (include / "cuda_bf16.h").exists()


_PINNED: list[tuple[Path, Path | None]] = []
"""use_library's choice: the one (library, include dir) pair _load tries; empty: the search above."""


def use_library(path: str | Path | None) -> None:
    """Load NVRTC from the file ``path`` from now on, with the CUDA headers kdtr finds as usual (``None``: search
    again). For comparing NVRTC versions: call it first thing in a process of its own, since a library once
    loaded stays in that process. A library that does not load raises NvrtcUnavailable, never a fallback."""
    if path is None:
        _PINNED.clear()
    else:
        include = next((inc for _, inc in _candidates() if _has_headers(inc)), None)
        _PINNED[:] = [(Path(path), include)]
    _load.cache_clear()


class _Lib:
    def __init__(self, lib: ctypes.CDLL, path: str, include: Path | None):
        self.lib, self.path, self.include = lib, path, include
        for fn in (
            "nvrtcCreateProgram", "nvrtcAddNameExpression", "nvrtcCompileProgram", "nvrtcGetProgramLogSize",
            "nvrtcGetProgramLog", "nvrtcGetCUBINSize", "nvrtcGetCUBIN", "nvrtcGetLoweredName",
            "nvrtcDestroyProgram", "nvrtcVersion",
        ):
            getattr(lib, fn).restype = ctypes.c_int
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        lib.nvrtcGetErrorString.argtypes = [ctypes.c_int]

    def check(self, status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"{what} failed: {self.lib.nvrtcGetErrorString(status).decode()}")


@lru_cache(maxsize=1)
def _load() -> _Lib:
    tried = []
    for lib, inc in _PINNED or _candidates():
        try:
            handle = ctypes.CDLL(str(lib))
            handle.nvrtcVersion  # noqa: B018 - make sure it really is NVRTC
        except (OSError, AttributeError) as e:
            tried.append(f"{lib} ({e.__class__.__name__})")
            continue
        return _Lib(handle, str(lib), inc if _has_headers(inc) else None)
    raise NvrtcUnavailable(f"NVRTC library not found; {_INSTALL_HINT}" + (f" [tried: {', '.join(tried)}]" if tried else ""))


def available() -> bool:
    """True where NVRTC and the CUDA headers can be loaded (never raises)."""
    try:
        return _load().include is not None
    except NvrtcUnavailable:
        return False


def version() -> tuple[int, int]:
    lib = _load()
    major, minor = ctypes.c_int(), ctypes.c_int()
    lib.check(lib.lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
    return major.value, minor.value


def cuda_include_dir() -> Path:
    """The CUDA headers that go with the loaded NVRTC (cuda_bf16.h and friends)."""
    inc = _load().include
    if inc is None:
        raise NvrtcUnavailable(f"CUDA headers (cuda_bf16.h) not found next to {_load().path}; {_INSTALL_HINT}")
    return inc


def supported_archs() -> list[str]:
    lib = _load().lib
    n = ctypes.c_int()
    if lib.nvrtcGetNumSupportedArchs(ctypes.byref(n)) != 0:
        return []
    arr = (ctypes.c_int * n.value)()
    lib.nvrtcGetSupportedArchs(arr)
    return [f"sm_{a}" for a in arr]


# ---- compiling -----------------------------------------------------------------------------------


def cache_dir() -> Path:
    root = os.environ.get("KDTR_CACHE_DIR")
    return Path(root) / "cubin" if root else Path.home() / ".cache" / "kdtr" / "cubin"


_INCLUDE_RE = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.M)


def _included_texts(text: str, dirs: list[Path], seen: dict[str, str]) -> dict[str, str]:
    """Quoted #include closure: resolved path -> text (system headers are keyed by version)."""
    for name in _INCLUDE_RE.findall(text):
        for d in dirs:
            path = (d / name).resolve()
            if path.is_file():
                if str(path) not in seen:
                    seen[str(path)] = path.read_text()
                    _included_texts(seen[str(path)], [path.parent, *dirs], seen)
                break
    return seen


@lru_cache(maxsize=4)
def _headers_fingerprint(include: Path) -> str:
    entries = sorted((p.name, p.stat().st_size) for p in include.iterdir() if p.is_file())
    return hashlib.sha256(repr(entries).encode()).hexdigest()


_ENTRY_RE = re.compile(r"Compiling entry function '([^']+)'")
_PROPS_RE = re.compile(r"Function properties for (\S+)")
_FRAME_RE = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED_RE = re.compile(r"Used (\d+) registers(?:, used (\d+) barriers)?")
_SMEM_RE = re.compile(r"(\d+) bytes smem")


def parse_resources(log: str) -> dict[str, Resources]:
    """Per-entry-function resource report from a ``--ptxas-options=-v`` log."""
    found: dict[str, dict] = {}
    current = None
    for line in log.splitlines():
        if m := _ENTRY_RE.search(line):
            current = m.group(1)
            found.setdefault(current, {})
        elif m := _PROPS_RE.search(line):
            current = m.group(1)
            found.setdefault(current, {})
        elif current is not None and (m := _FRAME_RE.search(line)):
            found[current].update(stack_frame=int(m[1]), spill_stores=int(m[2]), spill_loads=int(m[3]))
        elif current is not None and (m := _USED_RE.search(line)):
            found[current].update(registers=int(m[1]), barriers=int(m[2] or 0))
            if s := _SMEM_RE.search(line):
                found[current]["shared_bytes"] = int(s[1])
    return {k: Resources(**v) for k, v in found.items()}


def _warnings(log: str) -> list[str]:
    return [ln.strip() for ln in log.splitlines() if re.search(r"\bwarning\b", ln, re.I)]


WGMMA_SERIALIZED = ("C7514", "C7515", "C7517")
"""ptxas info codes (not warnings) for wgmma it serialized or a wait it injected: a silent slowdown."""


def wgmma_serialized(log: str) -> list[str]:
    """The ptxas info lines saying wgmma was serialized or a wait_group injected."""
    return [ln.strip() for ln in log.splitlines() if any(f"({code})" in ln for code in WGMMA_SERIALIZED)]


def compile_cuda(
    source_text: str,
    name_expressions,
    arch: str = "sm_90",
    options=(),
    include_dirs=(),
    defines: dict | None = None,
    *,
    name: str = "kernel.cu",
    lineinfo: bool = False,
    cache: bool = True,
) -> Compiled:
    """Compile ``source_text`` for ``arch`` (sm_XY, a real arch) and return the cubin.

    ``name_expressions`` are the kernels to instantiate (e.g. ``"k<float, 0>"``); their mangled
    names come back in ``Compiled.lowered``. kdtr's cuda/ directory and the CUDA headers are on
    the include path. Raises CompileError with the compiler's error lines, NvrtcUnavailable where
    there is no NVRTC.
    """
    lib = _load()
    names = [name_expressions] if isinstance(name_expressions, str) else list(name_expressions)
    inc_dirs = [Path(d).resolve() for d in include_dirs] + [CUDA_DIR.resolve(), cuda_include_dir()]
    opts = [*DEFAULT_OPTIONS, f"--gpu-architecture={arch}", "--ptxas-options=-v", *options]
    opts += [f"-D{k}" if v is None else f"-D{k}={v}" for k, v in sorted((defines or {}).items())]
    opts += ["-lineinfo"] if lineinfo or os.environ.get(LINEINFO_ENV) == "1" else []
    opts += [f"-I{d}" for d in inc_dirs]

    includes = _included_texts(source_text, inc_dirs, {})
    key_src = json.dumps(
        [source_text, sorted(includes.items()), names, opts, arch, version(), _headers_fingerprint(inc_dirs[-1])]
    )
    key = hashlib.sha256(key_src.encode()).hexdigest()[:32]
    cubin_path, meta_path = cache_dir() / f"{key}.cubin", cache_dir() / f"{key}.json"
    if cache and cubin_path.is_file() and meta_path.is_file():
        try:
            meta = json.loads(meta_path.read_text())
            return Compiled(
                cubin=cubin_path.read_bytes(), lowered=meta["lowered"], log=meta["log"], warnings=meta["warnings"],
                resources={k: Resources(**v) for k, v in meta["resources"].items()}, arch=arch,
                options=tuple(opts), key=key, path=cubin_path, from_cache=True,
            )
        except (OSError, ValueError, KeyError, TypeError):
            pass  # a damaged entry: compile again

    compiled = _compile(lib, source_text, names, opts, name, arch)
    compiled.key = key
    if cache:
        meta = {
            "lowered": compiled.lowered, "log": compiled.log, "warnings": compiled.warnings,
            "resources": {k: asdict(v) for k, v in compiled.resources.items()},
        }
        try:
            _atomic_write(cubin_path, compiled.cubin)
            _atomic_write(meta_path, json.dumps(meta, indent=1).encode())
            compiled.path = cubin_path
        except OSError:
            pass  # read-only cache: the caller still has the cubin bytes (path None)
    return compiled


def _compile(lib: _Lib, source_text: str, names: list[str], opts: list[str], name: str, arch: str) -> Compiled:
    L = lib.lib
    prog = ctypes.c_void_p()
    lib.check(L.nvrtcCreateProgram(ctypes.byref(prog), source_text.encode(), name.encode(), 0, None, None), "nvrtcCreateProgram")
    try:
        for ne in names:
            lib.check(L.nvrtcAddNameExpression(prog, ne.encode()), f"nvrtcAddNameExpression({ne!r})")
        c_opts = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
        status = L.nvrtcCompileProgram(prog, len(opts), c_opts)
        size = ctypes.c_size_t()
        L.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value)
        L.nvrtcGetProgramLog(prog, buf)
        log = buf.value.decode(errors="replace")
        if status != 0:
            raise CompileError(log or L.nvrtcGetErrorString(status).decode(), name, arch)
        L.nvrtcGetCUBINSize(prog, ctypes.byref(size))
        if size.value == 0:
            raise CompileError(f"no cubin produced (is {arch} a real sm_XY arch?)\n{log}", name, arch)
        cubin = ctypes.create_string_buffer(size.value)
        lib.check(L.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
        lowered = {}
        for ne in names:
            ptr = ctypes.c_char_p()
            lib.check(L.nvrtcGetLoweredName(prog, ne.encode(), ctypes.byref(ptr)), f"nvrtcGetLoweredName({ne!r})")
            lowered[ne] = ptr.value.decode()
    finally:
        L.nvrtcDestroyProgram(ctypes.byref(prog))
    return Compiled(
        cubin=cubin.raw, lowered=lowered, log=log, warnings=_warnings(log), resources=parse_resources(log),
        arch=arch, options=tuple(opts), key="",
    )


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def compile_file(path, name_expressions, arch: str = "sm_90", **kw) -> Compiled:
    """compile_cuda on a file; its own directory joins the include path."""
    path = Path(path)
    dirs = [path.parent, *kw.pop("include_dirs", ())]
    return compile_cuda(path.read_text(), name_expressions, arch, include_dirs=dirs, name=path.name, **kw)


__all__ = [
    "CUDA_DIR", "CompileError", "Compiled", "NvrtcUnavailable", "Resources", "available", "cache_dir",
    "compile_cuda", "compile_file", "cuda_include_dir", "parse_resources", "supported_archs", "version",
    "wgmma_serialized",
]
