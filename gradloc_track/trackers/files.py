"""Crash-safe local file writes: a reader sees whole records and whole files, never half of one.

- ``atomic_write_*``: a temp file beside the target, then ``os.replace`` (atomic on POSIX): a kill
  leaves the old file or the new one. The temp file is created with mode 0o666 so the umask
  decides, as for any file the user's process creates (a shared run dir stays readable).
- ``append_line``: one record per line. A write cut short (a full disk) is taken back (the file is
  truncated to where it was), so a torn line never glues onto the next record; a torn tail left by a
  kill is ended with a newline before the next record. Readers skip a line that is not whole.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def _write_all(path: Path, fd: int, data: bytes) -> None:
    """Every byte of ``data`` to ``fd`` (the one place our bytes hit the disk: tests inject faults here)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _temp_beside(path: Path) -> tuple[int, Path]:
    """A new file next to ``path``, mode 0o666 minus the umask (``mkstemp`` would force 0o600)."""
    for _ in range(100):
        tmp = path.with_name(f".{path.name}.{os.urandom(4).hex()}.tmp")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name beside {path}")


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write ``data`` to a temp file beside ``path``, then ``os.replace`` it.

    No fsync: that guards against power loss, not process death, and costs milliseconds per call.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _temp_beside(path)
    try:
        try:
            _write_all(tmp, fd, data)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, default=str))


def append_line(path: str | Path, line: str) -> None:
    """Append ``line`` as one whole record, or raise (``OSError``) having written nothing of it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = (line + "\n").encode("utf-8")
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        end = os.fstat(fd).st_size  # one writer per file (the run dir lock): nobody appends meanwhile
        if end and os.pread(fd, 1, end - 1) != b"\n":
            data = b"\n" + data  # a torn tail (a kill mid-write): this record starts on a line of its own
        try:
            _write_all(path, fd, data)
        except OSError:
            _take_back(fd, end)
            raise
    finally:
        os.close(fd)


def _take_back(fd: int, end: int) -> None:
    """Truncate a write cut short (truncating needs no space); if even that fails, the next append
    starts on a new line."""
    try:
        os.ftruncate(fd, end)
    except OSError:
        pass
