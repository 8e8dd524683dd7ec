"""pyflakes over the package, its maintainer tools and its tests: an undefined name in a GPU-only path (a
split of kdtr/kernels/flash/plan.py once left kdtr/kernels/flash/kernel.py using DK without importing it, a line no CPU
test reached) fails here, on the CPU, instead of on the next GPU run. Unused imports count too. The tools in tools/
stay few, each saying what it is and how to run it, and each answers --help without a GPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOOLS = ROOT / "tools"
"""The maintainer tools: GPU checks, timers, profilers (not part of the package)."""
MAX_TOOLS = 9
"""At most this many: a probe that serves one experiment lives on that experiment's branch."""


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
    files = sorted(p for d in ("kdtr", "tools", "tests") for p in (ROOT / d).rglob("*.py"))
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


def test_tools_are_few_and_each_says_how_to_run_it():
    assert not (ROOT / "scripts").exists(), "maintainer tools live in tools/ alone"
    tools = sorted(p for p in TOOLS.iterdir() if p.is_file())
    assert 0 < len(tools) <= MAX_TOOLS, [p.name for p in tools]
    for p in tools:
        text = p.read_text()
        if p.suffix == ".py":
            head = text.lstrip()
            assert head.startswith('"""'), f"{p.name}: open with a docstring saying what it is and how to run it"
            assert f"tools/{p.name}" in head.split('"""')[1], f"{p.name}: its docstring shows how to run it"
        else:
            assert p.suffix == ".sh" and text.startswith("#!/usr/bin/env bash\n#"), f"{p.name}: a bash script, a comment first"
            assert f"tools/{p.name}" in text.split("\nset ")[0], f"{p.name}: its opening comment shows how to run it"
            check = subprocess.run(["bash", "-n", str(p)], capture_output=True, text=True)
            assert check.returncode == 0, f"{p.name}: {check.stderr}"


@pytest.mark.parametrize("tool", sorted(p.name for p in TOOLS.glob("*.py")))
def test_each_python_tool_answers_help_without_a_gpu(tool):
    run = subprocess.run([sys.executable, str(TOOLS / tool), "--help"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and "usage:" in run.stdout, run.stderr[-2000:]
