"""SGLang's own tree-verify kernel, its triton ``extend_attention_fwd`` with a custom mask, as kdtr can call it:
the ``sglang-triton`` bench baseline (kdtr/bench/baselines.py) and ``kdtr verify -k
kdtr.adapters.sglang_triton:extend_attention`` (an SGLang-layout callable, kdtr/kernels/python.py).

Importing the kernel the ordinary way (``import sglang.kernels.ops.attention.extend_attention``) runs sglang's
package ``__init__``, which imports its whole runtime (transformers, the server, its compiled extensions). kdtr
needs one file. So ``load`` imports that file and the files it imports from the installed sglang package (where
pip put it: ``pip install 'kdtr[sglang]'``, or ``pip install --no-deps sglang``, needing torch and triton only),
without running any of sglang's package ``__init__`` modules, and with one module replaced: ``sglang.srt.utils``
(thousands of lines and heavy imports) by SHIM_UTILS, the four device queries the kernel files ask it
(``is_cuda``, ``is_hip``, ``is_gfx95_supported``, ``is_gfx1250_supported``, ``get_device_core_count``). Every
other import is SGLang's own file (``sglang/srt/environ.py``: standard library only). The file is
``sglang/kernels/ops/attention/extend_attention.py`` (sglang 0.5.2x) or, in older releases,
``sglang/srt/layers/attention/triton_ops/extend_attention.py``. sys.modules is left as it was. So a folder on
sys.path holding only those files (``sglang/kernels/ops/attention/{extend_attention,decode_attention,score_mod}.py``
and ``sglang/srt/environ.py``, taken from sglang's wheel) serves as well as an installed sglang.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import sys
import types
from functools import lru_cache
from pathlib import Path

KERNEL_MODULES = ("sglang.kernels.ops.attention.extend_attention",
                  "sglang.srt.layers.attention.triton_ops.extend_attention")
"""Where sglang releases keep extend_attention_fwd, newest first."""
SHIMMED = "sglang.srt.utils"
"""The one sglang module kdtr replaces (SHIM_UTILS)."""


class SglangUnavailable(RuntimeError):
    """sglang's kernel cannot be loaded here (not installed, or a file it imports needs what is missing)."""


def _shim_utils() -> types.ModuleType:
    """sglang.srt.utils as far as the kernel files use it: device queries answered by torch."""
    import torch

    m = types.ModuleType(SHIMMED)
    hip = getattr(torch.version, "hip", None) is not None
    m.is_hip = lambda: hip
    m.is_cuda = lambda: torch.cuda.is_available() and not hip
    m.is_gfx95_supported = lambda: False
    m.is_gfx1250_supported = lambda: False
    m.get_device_core_count = lambda device_id=0: torch.cuda.get_device_properties(device_id).multi_processor_count

    def missing(name):
        raise AttributeError(f"kdtr's shim of {SHIMMED} has no {name!r}: this sglang's kernel asks for more of it")

    m.__getattr__ = missing
    return m


class _Finder(importlib.abc.MetaPathFinder):
    """sglang.* from the package folder ``root``: packages as empty modules (their __init__ not run), modules
    from their files, SHIMMED from _shim_utils."""

    def __init__(self, root: Path):
        self.root = root

    def find_spec(self, name, path=None, target=None):
        if name != "sglang" and not name.startswith("sglang."):
            return None
        if name == SHIMMED:
            return importlib.util.spec_from_loader(name, _Given(_shim_utils()))
        where = self.root.parent.joinpath(*name.split("."))
        if where.is_dir():
            spec = importlib.machinery.ModuleSpec(name, _Given(None), is_package=True)
            spec.submodule_search_locations = [str(where)]
            return spec
        if where.with_suffix(".py").is_file():
            return importlib.util.spec_from_file_location(name, where.with_suffix(".py"))
        return None


class _Given(importlib.abc.Loader):
    """Loads a module made here (or an empty package)."""

    def __init__(self, module):
        self.module = module

    def create_module(self, spec):
        return self.module

    def exec_module(self, module):
        pass


def sglang_root() -> Path | None:
    """The installed sglang package's folder, found without importing it; None where there is none."""
    try:
        spec = importlib.util.find_spec("sglang")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def load():
    """SGLang's extend_attention_fwd (the module docstring says how it is loaded); SglangUnavailable, one line, with
    what is missing. Looked for once a process, found or not."""
    fn, why = _outcome()
    if fn is None:
        raise SglangUnavailable(why)
    return fn


@lru_cache(maxsize=1)
def _outcome():
    """(extend_attention_fwd, None), or (None, why it cannot be loaded): a failure is remembered as a success is."""
    try:
        return _load_kernel(), None
    except SglangUnavailable as e:
        return None, str(e)


def _load_kernel():
    root = sglang_root()
    if root is None:
        raise SglangUnavailable("sglang is not installed (pip install 'kdtr[sglang]', or pip install --no-deps sglang)")
    for dep in ("torch", "triton"):
        if importlib.util.find_spec(dep) is None:
            raise SglangUnavailable(f"sglang's triton kernel needs {dep}, which is not installed")
    name = next((n for n in KERNEL_MODULES if root.parent.joinpath(*n.split(".")).with_suffix(".py").is_file()), None)
    if name is None:
        raise SglangUnavailable(f"no extend_attention.py in {root} (looked for {', '.join(KERNEL_MODULES)})")
    saved = {k: v for k, v in sys.modules.items() if k == "sglang" or k.startswith("sglang.")}
    finder = _Finder(root)
    for k in saved:
        del sys.modules[k]
    sys.meta_path.insert(0, finder)
    try:
        module = importlib.import_module(name)
    except Exception as e:
        raise SglangUnavailable(f"cannot load {name} from {root}: {type(e).__name__}: {' '.join(str(e).split())}") from None
    finally:
        sys.meta_path.remove(finder)
        for k in [k for k in sys.modules if k == "sglang" or k.startswith("sglang.")]:
            del sys.modules[k]
        sys.modules.update(saved)
    fn = getattr(module, "extend_attention_fwd", None)
    if fn is None or "custom_mask" not in inspect.signature(fn).parameters:
        raise SglangUnavailable(f"{name} of {root} has no extend_attention_fwd taking a custom_mask")
    return fn


def unavailable_reason() -> str | None:
    """Why SGLang's kernel cannot be loaded here (one line), or None when it can."""
    return _outcome()[1]


def extend_attention(q, k_buffer, v_buffer, kv_indptr, kv_indices, k_extend, v_extend, qo_indptr, custom_mask,
                     mask_indptr, *, scale, out_dtype, out=None):
    """SGLang's target-verify call of extend_attention_fwd on its tensors (torch, the layout of
    kdtr.adapters.sglang.SglangBatch: a flat bool custom_mask over each request's [T, P + T]); returns out
    [B*T, H, 512] (``out``, when given, is written instead of a new tensor). Reads no device value: T comes from
    the shapes. SGLang serves MLA caches in bf16; on fp32 storage triton's dots default to TF32."""
    fn = load()  # SglangUnavailable first, before torch is asked for
    import torch

    B = qo_indptr.shape[0] - 1
    T = q.shape[0] // B
    if out is None:
        out = torch.empty(q.shape[0], q.shape[1], 512, dtype=torch.float32 if out_dtype == "fp32" else q.dtype,
                          device=q.device)
    kw = dict(q_extend=q, k_extend=k_extend, v_extend=v_extend, o_extend=out, k_buffer=k_buffer, v_buffer=v_buffer,
              qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=kv_indices, custom_mask=custom_mask,
              is_causal=False, mask_indptr=mask_indptr, max_len_extend=T, k_scale=1.0, v_scale=1.0, sm_scale=scale)
    params = inspect.signature(fn).parameters
    fn(**{k: v for k, v in kw.items() if k in params})
    return out


extend_attention.kdtr_layout = "sglang"
extend_attention.kdtr_framework = "torch"
extend_attention.kdtr_writes_lse = False
