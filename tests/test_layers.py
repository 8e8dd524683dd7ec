"""The package's layering (README, "Layout"), read from every import statement of the sources,
inside functions too, so that a stray import anywhere fails here rather than on a machine without
the package or as a cycle at run time.

- Stages import one way: inputs <- adapters <- kernels <- serving <- golden <- check <- bench <- cli. A module may
  import its own stage and the stages before it, never one after; nothing imports the CLI. (serving, a server's
  launch of the kernels on torch tensors, needs only the stages before it.)
- No import cycle between modules.
- Only kdtr/kernels/launch.py imports cupy, only kdtr/cli/report.py imports rich, only kdtr/cli/
  imports click: the pure-numpy stages import and test without a GPU or a terminal library.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

KDTR = Path(__file__).resolve().parent.parent / "kdtr"

STAGES = ("inputs", "adapters", "kernels", "serving", "golden", "check", "bench", "cli")
"""kdtr's stage folders, in import order: each may import the ones before it."""
BASE = {"kdtr.errors", "kdtr.version"}
"""Root modules every stage may import (they import nothing of kdtr)."""
FACE = {"kdtr", "kdtr.__main__"}
"""The package's public face and ``python -m kdtr``: they import from every stage, nothing imports them."""

ONLY_IN = {"cupy": ("kdtr/kernels/launch.py",), "rich": ("kdtr/cli/report.py",), "click": ("kdtr/cli/",)}
"""Third-party package -> the files (or folders, ending in /) allowed to import it."""


def module_name(path: Path) -> str:
    parts = path.relative_to(KDTR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def sources() -> dict[str, str]:
    return {module_name(p): p.read_text() for p in sorted(KDTR.rglob("*.py"))}


def imports(source: str, module: str) -> set[str]:
    """Every module named by an import statement in ``source`` (absolute and relative)."""
    names = set()
    package = module if module in PACKAGES else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            names.add(base)
            names |= {f"{base}.{a.name}" for a in node.names}
    return names


PACKAGES = {module_name(p) for p in KDTR.rglob("__init__.py")}
MODULES = sources()


def kdtr_imports(module: str) -> set[str]:
    """The kdtr modules ``module`` imports (a ``from pkg import name`` counts as pkg.name where that is a module)."""
    return {n for n in imports(MODULES[module], module) if n in MODULES and n != module}


def stage(module: str) -> int | None:
    parts = module.split(".")
    return STAGES.index(parts[1]) if len(parts) > 1 and parts[1] in STAGES else None


def test_every_module_lives_in_a_stage_or_is_named_as_base_or_face():
    loose = sorted(m for m in MODULES if stage(m) is None and m not in BASE | FACE)
    assert not loose, f"modules outside the stage folders: {loose}"


def test_stages_import_one_way():
    wrong = []
    for m in MODULES:
        for dep in kdtr_imports(m):
            if dep in FACE:
                wrong.append(f"{m} -> {dep}")
            elif m in BASE and dep not in BASE:
                wrong.append(f"{m} -> {dep}")
            elif stage(m) is not None and stage(dep) is not None and stage(dep) > stage(m):
                wrong.append(f"{m} -> {dep}")
    assert not wrong, "imports against the stage order: " + ", ".join(sorted(wrong))


def test_no_import_cycle():
    graph = {m: {d for d in kdtr_imports(m) if d not in PACKAGES} for m in MODULES}
    state: dict[str, int] = {}

    def visit(m, path):
        state[m] = 1
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(d):] + [d]))
            if d not in state:
                visit(d, path + [d])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


def test_imports_sees_nested_relative_and_from_imports():
    src = "import os.path\nfrom rich.table import Table\ndef f():\n    import cupy as cp\n    from . import x\n"
    assert {"os.path", "rich.table", "cupy", "kdtr.golden", "kdtr.golden.x"} <= imports(src, "kdtr.golden.bundle")


def test_the_checks_catch_an_upward_import_and_a_cycle(monkeypatch):
    """The checks above can fail: a planted upward import and a planted cycle are reported."""
    fake = dict(MODULES)
    fake["kdtr.inputs.presets"] = MODULES["kdtr.inputs.presets"] + "\nfrom kdtr.check import compare\n"
    fake["kdtr.check.compare"] = MODULES["kdtr.check.compare"] + "\nfrom kdtr.check import case\n"
    fake["kdtr.check.case"] = MODULES["kdtr.check.case"] + "\nfrom kdtr.check import compare\n"
    monkeypatch.setattr(__import__(__name__), "MODULES", fake)
    with pytest.raises(AssertionError, match="kdtr.inputs.presets -> kdtr.check.compare"):
        test_stages_import_one_way()
    with pytest.raises(AssertionError, match="import cycle"):
        test_no_import_cycle()


@pytest.mark.parametrize("package", sorted(ONLY_IN))
def test_package_imported_only_by_its_layer(package):
    users = {str(p.relative_to(KDTR.parent)) for p in KDTR.rglob("*.py")
             if package in {n.split(".")[0] for n in imports(p.read_text(), module_name(p))}}
    stray = sorted(u for u in users if not u.startswith(ONLY_IN[package]))
    assert not stray, f"{package} imported by {stray}"
    assert users, f"no module imports {package}: the table above is stale"
