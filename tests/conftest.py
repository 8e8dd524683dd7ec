"""What the tests need of the machine, declared once as markers, and the paths they share.

- ``@pytest.mark.gpu``: a CUDA GPU and cupy; skipped cleanly where there is none (CI).
- ``@pytest.mark.nvrtc``: NVRTC and the CUDA headers (``pip install 'kdtr[nvrtc]'``); compile-only,
  so these run in CI.
- ``@pytest.mark.sanitizer``: compute-sanitizer (a CUDA toolkit, or ``pip install 'kdtr[sanitizer]'``).

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
