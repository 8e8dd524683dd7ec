"""Rendering: the only module that imports rich, and the only one that writes rich markup.

Commands hand plain data (dataclasses, dicts) to one of these functions; every table goes
through ``table`` so that styles and number formats stay the same everywhere. Table cells are
markup: plain text goes in through ``escape``, styled text through ``status_text``, ``best``
and ``warn``.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Iterable, Sequence

from rich import box
from rich.console import Console
from rich.markup import escape as _escape
from rich.measure import Measurement
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.tree import Tree as RichTree

STATUS_STYLE = {
    "PASS": "bold green", "SKIPPED": "yellow", "FAIL_NUMERIC": "bold red", "NAN": "bold red",
    "UNWRITTEN": "bold red", "SHAPE": "bold red", "RACE": "bold magenta", "COMPILE_ERROR": "bold red",
    "RUNTIME_ERROR": "bold red", "TIMEOUT": "bold red", "SANITIZER": "bold red", "CAPTURE_ERROR": "bold red",
    "SAME": "bold green", "faster": "bold green", "slower": "bold red", "same": "dim",
    "DIFFERS": "bold red", "CLEAN": "bold green", "STACK": "yellow", "SPILLS": "bold red", "WGMMA_SERIALIZED": "bold red",
}

def _width() -> int | None:
    """The terminal's width on a terminal; else $COLUMNS, or 200 (files and pipes)."""
    if sys.stdout.isatty():
        return None
    cols = os.environ.get("COLUMNS", "")
    return int(cols) if cols.isdigit() and int(cols) >= 40 else 200


_console = Console(highlight=False, soft_wrap=False, width=_width())
_err = Console(stderr=True, highlight=False, soft_wrap=True)


def console() -> Console:
    return _console


def escape(text: str) -> str:
    """User or compiler text shown verbatim (no [markup] interpretation)."""
    return _escape(str(text))


def error(message: str) -> None:
    """One line on stderr, no traceback."""
    _err.print(f"[bold red]error:[/] {escape(message)}", markup=True, highlight=False)


def note(message: str) -> None:
    """A line of plain text (no markup)."""
    _console.print(message, markup=False)


def notice(head: str, message: str) -> None:
    """A highlighted head, then plain text: what a reader must not miss (e.g. no GPU here)."""
    _console.print(f"[bold yellow]{escape(head)}[/] {escape(message)}")


def details(title: str, items: Iterable[tuple[str, str]]) -> None:
    """``label: text`` lines under a table, each wrapped to the terminal (long messages); the
    further lines of a text with newlines follow indented under its label."""
    items = list(items)
    if not items:
        return
    _console.print(f"[bold]{escape(title)}[/]")
    for label, text in items:
        first, *more = str(text).split("\n")
        _console.print(f"  [bold]{escape(label)}[/]: {escape(first)}", soft_wrap=False)
        for line in more:
            _console.print(f"    {escape(line)}", soft_wrap=False)


def status_text(status: str) -> str:
    return f"[{STATUS_STYLE.get(status, 'white')}]{status}[/]"


def best(text: str) -> str:
    """A table cell marked as the best of its group."""
    return f"[bold green]{escape(text)}[/]"


def warn(text: str) -> str:
    """A table cell holding a warning or a failure's text."""
    return f"[yellow]{escape(text)}[/]"


def fmt(x, digits: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        if x == 0:
            return "0"
        return f"{x:.{digits}g}" if abs(x) < 1e4 and abs(x) >= 1e-3 else f"{x:.{digits - 1}e}"
    return str(x)


def table(title: str, columns: Sequence[str], rows: Iterable[Sequence], right: Sequence[str] = (), caption: str | None = None,
          no_wrap: Sequence[str] = (), wide: bool = False) -> None:
    """The one table helper: a title, header, rows of already-formatted cells (markup). Columns in
    ``no_wrap`` are never folded (statuses, figures); the others fold to fit the terminal, unless
    ``wide``: then nothing folds and lines run past a narrow terminal."""
    t = Table(title=escape(title), caption=escape(caption) if caption else None, header_style="bold cyan",
              show_lines=False, box=box.SIMPLE_HEAD, show_edge=False, title_justify="left", caption_justify="left")
    for c in columns:
        t.add_column(escape(c), justify="right" if c in right else "left", overflow="fold", no_wrap=wide or c in no_wrap)
    for r in rows:
        t.add_row(*[c if isinstance(c, str) else fmt(c) for c in r])
    if wide:  # rich caps a print at the console's width: widen the console for this table alone
        natural = Measurement.get(_console, _console.options.update_width(1 << 16), t).maximum
        old, _console.width = _console.width, max(_console.width, natural)
        try:
            _console.print(t, crop=False)
        finally:
            _console.width = old
    else:
        _console.print(t)
    _console.print()


@contextlib.contextmanager
def progress(total: int, label: str, show: bool = True):
    """A progress bar on a terminal (show=False: none, e.g. while JSON goes to stdout); yields
    advance(text) to call once per finished item."""
    if not show or not sys.stdout.isatty():
        yield lambda text="": None
        return
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.fields[item]}"), console=_console, transient=False) as p:
        task = p.add_task(label, total=total, item="")
        yield lambda text="": p.update(task, advance=1, item=text)


def kv_table(title: str, pairs: Iterable[tuple[str, object]]) -> None:
    table(title, ["field", "value"], [(escape(k), escape(fmt(v) if not isinstance(v, str) else v)) for k, v in pairs])


def tree_picture(parent, depth, labels=None, max_nodes: int = 64) -> None:
    """The tree drawn with rich (node index, depth, optional label)."""
    T = len(parent)
    root = RichTree("[bold]0[/] (root)")
    nodes = {0: root}
    for i in range(1, min(T, max_nodes)):
        lab = f" {labels[i]}" if labels is not None else ""
        nodes[i] = nodes[int(parent[i])].add(f"{i} [dim]d={int(depth[i])}{lab}[/]")
    _console.print(root)
    if T > max_nodes:
        _console.print(f"[dim]... {T - max_nodes} more nodes not drawn[/]")


def mask_picture(visible, max_nodes: int = 64) -> None:
    """Rows = query nodes, columns = tail keys; '#' visible, '.' masked."""
    T = min(len(visible), max_nodes)
    lines = ["     " + "".join(str(c % 10) for c in range(T))]
    for r in range(T):
        lines.append(f"{r:4d} " + "".join("#" if visible[r][c] else "." for c in range(T)))
    _console.print("\n".join(lines), markup=False)


def histogram(title: str, counts: dict, width: int = 40) -> None:
    if not counts:
        return
    top = max(counts.values())
    rows = [(str(k), str(v), "█" * max(1, round(width * v / top))) for k, v in sorted(counts.items())]
    table(title, ["depth", "nodes", ""], rows, right=("nodes",))
