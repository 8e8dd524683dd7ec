"""kdtr: golden references, verification and benchmarks for tree-verify MLA attention kernels.

The public API, one name per stage's main entry points. Names resolve on first use, so that
``import kdtr`` (and ``kdtr --help``) stays instant and imports neither numpy work nor cupy.
"""

from __future__ import annotations

from importlib import import_module

from kdtr.version import __version__

_EXPORTS = {
    # inputs: shapes, trees, the operator's arrays
    "CaseSpec": "kdtr.inputs.cases", "build_problem": "kdtr.inputs.cases", "Problem": "kdtr.inputs.problem",
    "visible_flops": "kdtr.inputs.problem", "suite": "kdtr.inputs.suites",
    # adapters: a server's layouts
    "to_sglang": "kdtr.adapters.sglang", "from_sglang": "kdtr.adapters.sglang",
    # kernels: built-ins, user CUDA files and Python callables behind one spec string
    "resolve_kernel": "kdtr.kernels.registry", "builtin_names": "kdtr.kernels.registry", "Bug": "kdtr.kernels.bugs",
    # golden: the float64 reference and the .kdtr bundle
    "reference": "kdtr.golden.reference", "Bundle": "kdtr.golden.bundle", "load_bundle": "kdtr.golden.bundle",
    "save_bundle": "kdtr.golden.bundle", "generate": "kdtr.golden.generate", "find_bundles": "kdtr.golden.store",
    # check: judging outputs
    "Status": "kdtr.check.compare", "compare": "kdtr.check.compare", "verify_bundle": "kdtr.check.case",
    "CaseResult": "kdtr.check.case", "run_verify": "kdtr.check.suite", "VerifyReport": "kdtr.check.suite",
    # bench: timing against the roofline
    "bench_shape": "kdtr.bench.run",
    # errors
    "InputError": "kdtr.errors",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'kdtr' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
