"""Crash-safe files: every file kdtr writes appears complete or not at all.

A writer fills a temporary file next to its target (``.{target name}.{pid}.{8 hex}.tmp``: no
tool mistakes one for a bundle), fsyncs it and renames it into place; a killed writer leaves only
its temporary file, which the next ``kdtr gen`` in that folder removes once the writer is gone.
docs/FORMAT.md section 8 is the contract; kdtr/golden/generate.py orders renames and manifest rewrites.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
from typing import IO, Iterator

TEMP_NAME = re.compile(r"^\.(?P<target>.+)\.(?P<pid>\d+)\.[0-9a-f]{8}\.tmp$")
"""Temporary files kdtr writes next to their target: ``.{target name}.{pid}.{8 hex}.tmp``."""


def temp_path(path) -> str:
    """A fresh temporary name next to ``path``, owned by this process (see remove_stale_temps)."""
    folder, base = os.path.split(os.path.abspath(os.fspath(path)))
    return os.path.join(folder, f".{base}.{os.getpid()}.{secrets.token_hex(4)}.tmp")


@contextlib.contextmanager
def exclusive_writer(path, text: bool = False) -> Iterator[IO]:
    """Yield a newly created file (it must not exist); on clean exit it is fsynced, else removed."""
    path = os.fspath(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    kw = {"mode": "w", "encoding": "utf-8", "newline": "\n"} if text else {"mode": "wb"}
    try:
        with os.fdopen(fd, **kw) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise


@contextlib.contextmanager
def atomic_writer(path, text: bool = False) -> Iterator[IO]:
    """Yield a file; on clean exit it is fsynced and renamed onto ``path``, else removed."""
    tmp = temp_path(path)
    with exclusive_writer(tmp, text) as f:
        yield f
    publish(tmp, path)


def publish(tmp, path) -> None:
    """Rename a complete temporary file onto ``path`` (atomic) and make the rename durable."""
    try:
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(os.path.dirname(os.path.abspath(os.fspath(path))))


def remove_stale_temps(folder) -> list[str]:
    """Delete kdtr temporary files in ``folder`` whose writing process is gone; returns their names.

    A killed writer leaves its temporary file behind (never a half-written target). Files of a
    process that still runs on this machine are kept: it may be another kdtr writing there now.
    """
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    removed = []
    for name in names:
        m = TEMP_NAME.match(name)
        if m and not _alive(int(m["pid"]), os.path.join(folder, name)):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(folder, name))
                removed.append(name)
    return sorted(removed)


def _alive(pid: int, path: str | None = None) -> bool:
    """Could process ``pid`` still be writing ``path``? A zombie cannot, nor a process that started
    after the file was last written (its pid was reused: pool workers of a killed run come and go)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OverflowError, OSError):
        return True  # exists under another user (EPERM), or cannot tell: keep its files
    started = _linux_start_time(pid)
    if started is None:
        return True
    if started == "zombie":
        return False
    try:
        return started <= os.path.getmtime(path) + 1.0 if path else True
    except OSError:
        return False  # the file is gone already


def _linux_start_time(pid: int):
    """Epoch seconds at which ``pid`` started, "zombie", or None where /proc cannot tell."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after "pid (comm)": state is field 3
        if fields[0] in ("Z", "X"):
            return "zombie"
        with open("/proc/stat") as f:
            btime = next(int(ln.split()[1]) for ln in f if ln.startswith("btime"))
        return btime + int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: start time in ticks
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def _fsync_dir(folder: str) -> None:
    """Make the rename durable where the platform allows it."""
    with contextlib.suppress(OSError, AttributeError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_write_bytes(path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (temp file, fsync, rename)."""
    with atomic_writer(path) as f:
        f.write(data)
