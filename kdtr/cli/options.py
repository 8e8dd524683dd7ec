"""What every command shares: the ``--json`` convention, output paths checked before any work
starts, and option values checked under the option's own name.

``--json`` takes an optional value: bare ``--json`` or ``--json -`` prints the JSON to stdout
(and nothing else there), ``--json PATH.json`` shows the usual table and writes the file
atomically. Bad values raise kdtr.errors.InputError: one line, exit code 2, before anything runs.
Only light modules are imported here: ``kdtr --help`` loads every command module.
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

import click

from kdtr.errors import InputError

EXIT_OK, EXIT_FAIL, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
"""Exit codes: success; a check failed (or nothing was verified); bad usage or input; stopped by Ctrl-C or
SIGTERM (what was done by then is still shown and written)."""
STDOUT = "-"
"""The --json value that means stdout (what a bare --json gives)."""


def json_option(what: str):
    """The --json option of a command; ``what`` says what goes out ("the report", "the rows")."""
    return click.option(
        "--json", "json_to", is_flag=False, flag_value=STDOUT, default=None, metavar="[PATH.json|-]",
        help=f"{what} as JSON: bare --json (or --json -) prints it to stdout, --json PATH.json writes that file.")


def check_output(path: str | None, option: str, suffix: str | None = None) -> None:
    """InputError unless ``path`` can be written once the work is done: its folder exists and is
    writable, it is no folder itself, and it ends in ``suffix`` (so that an argument after a bare
    --json, a bundle or a suite name, is never taken for the file to write)."""
    if path is None or (path == STDOUT and option == "--json"):
        return
    p = Path(path)
    hint = "; bare --json or --json - prints to stdout (give bundles before --json)" if option == "--json" else ""
    if p.is_dir():
        raise InputError(f"{option} {path}: is a folder; name a file in it{hint}")
    if suffix and p.suffix.lower() != suffix:
        raise InputError(f"{option} {path}: the file name must end in {suffix}{hint}")
    folder = p.parent
    if not folder.is_dir():
        raise InputError(f"{option} {path}: folder {str(folder)!r} does not exist; create it or pick another path")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise InputError(f"{option} {path}: folder {str(folder)!r} is not writable")


def dumps(data) -> str:
    return json.dumps(data, indent=1, default=str)


def write_file(path: str, text: str, option: str) -> None:
    """Write ``text`` atomically; a failure (the disk filled up meanwhile) is one line, after the
    results were shown."""
    from kdtr.golden.atomic import atomic_write_bytes

    try:
        atomic_write_bytes(path, text.encode())
    except OSError as e:
        raise InputError(f"{option} {path}: cannot write it ({e.strerror or e}); the results are shown above") from None


def checkpoint_to(json_to: str | None) -> Callable[[dict], None] | None:
    """For a long run with --json PATH: a function that rewrites PATH with the report so far, so a run that is
    killed keeps what it did. A failed write (the disk filled up) lets the run go on: the final write says what
    is wrong, after the results are shown. None where no file was asked for."""
    if json_to in (None, STDOUT):
        return None

    def save(data: dict) -> None:
        from kdtr.golden.atomic import atomic_write_bytes

        try:
            atomic_write_bytes(json_to, (dumps(data) + "\n").encode())
        except OSError:
            pass

    return save


def emit(data, json_to: str | None, render: Callable[[object], None]) -> None:
    """The --json convention: JSON alone on stdout, or the table and then (when asked) the file.
    The table comes first, so results are on screen even if the file cannot be written."""
    if json_to == STDOUT:
        click.echo(dumps(data))
        return
    render(data)
    if json_to:
        write_file(json_to, dumps(data) + "\n", "--json")


def option_list(option: str, text: str, conv=None) -> list:
    """kdtr.inputs.presets.parse_list of an option's value (sizes by default, ``int``, ``str``), its
    ValueError as one line that names the option: "--budget 16x: not a whole number: '16x' (...)"."""
    from kdtr.inputs import presets

    try:
        return presets.parse_list(text, conv or presets.parse_size)
    except ValueError as e:
        raise InputError(f"{option} {text}: {e}") from None


def at_least(option: str, value, low: int | float, what: str = "") -> None:
    """InputError unless ``value`` (None: not given) is >= low."""
    if value is not None and not value >= low:
        raise InputError(f"{option} must be >= {low}{what}, got {value}")


def exclusive(**given) -> None:
    """InputError when more than one of the named options was given (name: value or None)."""
    named = [f"--{k.replace('_', '-')}" for k, v in given.items() if v not in (None, False, ())]
    if len(named) > 1:
        raise InputError(f"give {' or '.join(named)}, not both")


@contextmanager
def stop_on_sigterm():
    """SIGTERM (`timeout`, a job scheduler) stops a long run as Ctrl-C does (KeyboardInterrupt), so the work
    done by then is still shown and written; the handler is the run's only."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise KeyboardInterrupt

    before = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)
