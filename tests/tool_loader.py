"""A maintainer tool of tools/ (a script, not a package) loaded as a module, for its tests (tests/ is on sys.path
under pytest)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

TOOLS = Path(__file__).resolve().parent.parent / "tools"


def load_tool(name: str):
    """tools/NAME.py as a module of its own (its main() not run)."""
    spec = importlib.util.spec_from_file_location(f"kdtr_tools_{name}", TOOLS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
