"""The layering the package promises (README, "Layout"): only kdtr/launch.py imports cupy, only
kdtr/report.py imports rich and only kdtr/cli.py imports click, so that the pure-numpy parts import
and test without a GPU or a terminal library. Read from the sources' import statements (inside
functions too), so that a stray import anywhere fails here rather than on a machine without it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

KDTR = Path(__file__).resolve().parent.parent / "kdtr"

ONLY_IN = {"cupy": {"launch.py"}, "rich": {"report.py"}, "click": {"cli.py"}}
"""Third-party package -> the modules allowed to import it."""


def imported_packages(source: str) -> set[str]:
    """Top-level package names of every import statement in ``source``."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_imported_packages_sees_nested_and_from_imports():
    src = "import os.path\nfrom rich.table import Table\ndef f():\n    import cupy as cp\n    from . import x\n"
    assert imported_packages(src) == {"os", "rich", "cupy"}


@pytest.mark.parametrize("package", sorted(ONLY_IN))
def test_package_imported_only_by_its_layer(package):
    users = {p.name for p in KDTR.glob("*.py") if package in imported_packages(p.read_text())}
    assert users <= ONLY_IN[package], f"{package} imported by {sorted(users - ONLY_IN[package])}"
    assert users, f"no module imports {package}: the table above is stale"
