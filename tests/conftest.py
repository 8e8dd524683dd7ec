"""What the tests need of the machine, declared once as markers, and the paths and fixtures they share.

- ``@pytest.mark.gpu``: a CUDA GPU and cupy; skipped cleanly where there is none (CI).
- ``@pytest.mark.nvrtc``: NVRTC and the CUDA headers (``pip install 'kdtr[nvrtc]'``); compile-only,
  so these run in CI.
- ``@pytest.mark.sanitizer``: compute-sanitizer (a CUDA toolkit, or ``pip install 'kdtr[sanitizer]'``).

Fixtures: ``kdtr`` runs the command line in this process (stdout and stderr apart); ``small_dir``
is a folder of three small bundles (two bf16 cases emulate-flash takes, one fp32 it SKIPs); ``hopper_only``
skips a test parametrised with ``name="flash-sm90"`` off sm_90.

tests/ is on sys.path (this file's folder), so tests and their child processes import
``kernels_for_tests``.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
"""The checkout."""
GOLDENS_CI = ROOT / "goldens" / "ci"
"""The committed ci goldens."""
TEST_CUDA = Path(__file__).resolve().parent / "cuda"
"""Small CUDA files that misbehave on purpose (tests/cuda/)."""


@cache
def _missing(marker: str) -> str | None:
    """Why the machine lacks what ``marker`` needs, or None."""
    if marker == "gpu":
        from kdtr.kernels import launch

        return None if launch.gpu_available() else f"needs a CUDA GPU and cupy ({launch.gpu_unavailable_reason()})"
    if marker == "nvrtc":
        from kdtr.kernels import nvrtc

        return None if nvrtc.available() else "NVRTC + CUDA headers not installed (pip install 'kdtr[nvrtc]')"
    if marker == "sanitizer":
        from kdtr.check import isolate

        return None if isolate.find_sanitizer() else "compute-sanitizer not found (CUDA toolkit, or pip install 'kdtr[sanitizer]')"
    return None


def pytest_collection_modifyitems(config, items):
    for item in items:
        for marker in ("gpu", "nvrtc", "sanitizer"):
            if item.get_closest_marker(marker) and (why := _missing(marker)):
                item.add_marker(pytest.mark.skip(reason=why))
                break


SMALL_CASES = [
    dict(model="kimi-k2", heads=2, prefix_lens=(0, 1, 63, 64, 65, 130), budget=4, page_size=16),
    dict(model="deepseek-v3", heads=2, prefix_lens=(70,), family="chain", budget=8, page_size=16),
    dict(model="kimi-k2", heads=1, prefix_lens=(5,), family="star", budget=3, page_size=1, kv_dtype="fp32",
         out_dtype="fp32"),
]
"""Two bf16 cases emulate-flash takes (one with a long prefix list in its name) and one fp32 it SKIPs."""


def _invoke(*args, **kw):
    from click.testing import CliRunner

    from kdtr.cli import main

    return CliRunner().invoke(main, [str(a) for a in args], **kw)


@pytest.fixture
def hopper_only(request):
    """Skips a test parametrised with name="flash-sm90" off sm_90 (its Caps would SKIP every case there)."""
    name = request.node.callspec.params.get("name") if hasattr(request.node, "callspec") else None
    if name == "flash-sm90":
        from kdtr.kernels.launch import device_arch

        if device_arch() != "sm_90":
            pytest.skip(f"flash-sm90 needs an sm_90 GPU; this one is {device_arch()}")


@pytest.fixture
def kdtr():
    """kdtr(*ARGS): `kdtr ARGS` run in this process; the click Result (stdout and stderr apart)."""
    return _invoke


@pytest.fixture(scope="session")
def small_dir(tmp_path_factory) -> Path:
    from kdtr.golden.generate import generate
    from kdtr.inputs.cases import CaseSpec

    out = tmp_path_factory.mktemp("small")
    generate([CaseSpec(**kw) for kw in SMALL_CASES], out)
    return out
