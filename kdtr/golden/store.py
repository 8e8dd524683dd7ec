"""Where bundles come from: files, directories, globs, or a suite's name (its committed goldens
under goldens/, or generated once into the cache)."""

from __future__ import annotations

import glob as globlib
import os
from pathlib import Path

from kdtr.errors import InputError
from kdtr.inputs import suites

REPO_GOLDENS = Path(__file__).resolve().parents[2] / "goldens"
"""The committed goldens of a source checkout (goldens/<suite>/)."""


def find_bundles(sources: list[str], cache_dir: str | os.PathLike | None = None, jobs: int = 1,
                 force: bool = False) -> list[Path]:
    """Bundles from files, directories, globs or suite names (generated into a cache if missing).

    force: go ahead with generating a suite even where generation's own checks would refuse.
    """
    found: list[Path] = []
    for src in sources:
        p = Path(src)
        if src in suites.SUITES:
            found += suite_bundles(src, cache_dir, jobs, force=force)
        elif p.is_dir():
            hits = sorted(p.rglob("*.kdtr"))
            if not hits:
                raise InputError(f"{src}: directory holds no .kdtr bundles (generate some with `kdtr gen`)")
            found += hits
        elif p.is_file():
            found.append(p)
        elif any(ch in src for ch in "*?["):
            hits = sorted(Path(h) for h in globlib.glob(src, recursive=True) if h.endswith(".kdtr"))
            if not hits:
                raise InputError(f"{src}: pattern matches no .kdtr bundles")
            found += hits
        else:
            raise InputError(f"{src}: no such bundle, directory or suite (suites: {', '.join(suites.SUITES)})")
    seen, uniq = set(), []
    for f in found:
        if f.resolve() not in seen:
            seen.add(f.resolve())
            uniq.append(f)
    return uniq


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    root = cache_dir or os.environ.get("KDTR_CACHE_DIR") or Path.home() / ".cache" / "kdtr"
    return Path(root)


def suite_bundles(name: str, cache_dir=None, jobs: int = 1, force: bool = False) -> list[Path]:
    """The bundle files of a suite: committed goldens where present, else generated on demand.

    force: generate even where the memory check (kdtr.resources) would refuse.
    """
    from kdtr.golden.generate import generate

    specs = suites.suite(name)
    committed = REPO_GOLDENS / name
    if name in suites.COMMITTED and all((committed / f"{s.name}.kdtr").exists() for s in specs):
        return [committed / f"{s.name}.kdtr" for s in specs]
    out = cache_root(cache_dir) / "suites" / name
    missing = [s for s in specs if not (out / f"{s.name}.kdtr").exists()]
    if missing:
        generate(missing, out, jobs=jobs, force=force)
    return [out / f"{s.name}.kdtr" for s in specs]
