"""pyflakes over the package, its scripts and its tests: an undefined name in a GPU-only path (the
session-13 split of kdtr/kernels/flash/plan.py left kdtr/kernels/flash/kernel.py using DK without importing it, a line no CPU
test reached) fails here, on the CPU, instead of on the next GPU run. Unused imports count too."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_pyflakes_finds_nothing():
    api = pytest.importorskip("pyflakes.api", reason="pyflakes (the test extra) is not installed")
    from pyflakes import reporter

    class Collect(reporter.Reporter):
        def __init__(self):
            self.messages = []

        def unexpectedError(self, filename, msg):  # noqa: N802 (pyflakes' names)
            self.messages.append(f"{filename}: {msg}")

        def syntaxError(self, filename, msg, lineno, offset, text):  # noqa: N802
            self.messages.append(f"{filename}:{lineno}: {msg}")

        def flake(self, message):
            self.messages.append(str(message))

    found = Collect()
    files = sorted(p for d in ("kdtr", "scripts", "tests", "benchmarks") for p in (ROOT / d).rglob("*.py"))
    assert len(files) > 60
    for path in files:
        api.check(path.read_text(), str(path.relative_to(ROOT)), found)
    assert not found.messages, "\n".join(found.messages)


def test_the_check_sees_an_undefined_name():
    api = pytest.importorskip("pyflakes.api", reason="pyflakes (the test extra) is not installed")
    from pyflakes import reporter

    seen = []
    rep = reporter.Reporter(None, None)
    rep.flake = lambda m: seen.append(str(m))
    api.check("def f():\n    return DK * 2\n", "planted.py", rep)
    assert seen and "undefined name 'DK'" in seen[0]
