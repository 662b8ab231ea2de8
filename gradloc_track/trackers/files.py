"""Crash-safe local file writes: a reader sees whole records and whole files, never half of one.

- ``atomic_write_*``: a temp file beside the target (same directory, so same file system), flushed
  to disk (``fsync``), then ``os.replace`` (atomic on POSIX) and the directory synced: a kill (or a
  power cut) leaves the old file or the new one, never an empty or half-written one. Every file we
  rewrite goes through here: run records, table parts, the report page, the ledger's files,
  blocklists. The temp file is created with mode 0o666 so the umask decides, as for any file the
  user's process creates (a shared run dir stays readable).
- ``append_line``: one record per line. A write cut short (a full disk) is taken back (the file is
  truncated to where it was), so a torn line never glues onto the next record; a torn tail left by a
  kill is ended with a newline before the next record. Readers skip a line that is not whole.
"""
from __future__ import annotations

import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, Iterator


def _write_all(path: Path, fd: int, data: bytes) -> None:
    """Every byte of ``data`` to ``fd`` (the one place our bytes hit the disk: tests inject faults here)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _temp_beside(path: Path, made: list[Path]) -> int:
    """A new file next to ``path``, mode 0o666 minus the umask (``mkstemp`` would force 0o600); its name
    goes into ``made`` before it exists, so a SIGTERM at any point leaves a name to clean up."""
    for _ in range(100):
        made[:] = [path.with_name(f".{path.name}.{os.urandom(4).hex()}.tmp")]
        try:
            return os.open(made[0], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            made.clear()  # someone else's
    raise FileExistsError(f"no free temporary name beside {path}")


@contextmanager
def _replacing(path: Path) -> Iterator[tuple[int, Path]]:
    """``(fd, name)`` of a temp file beside ``path`` for the block to fill and fsync; then renamed over
    ``path`` and the folder synced. Any exception (``SystemExit`` included) removes the temp file and
    leaves ``path`` as it was."""
    path.parent.mkdir(parents=True, exist_ok=True)
    made: list[Path] = []
    try:
        fd = _temp_beside(path, made)
        yield fd, made[0]
        os.replace(made[0], path)
    except BaseException:
        for tmp in made:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        raise
    _sync_dir(path.parent)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write ``data`` to a temp file beside ``path``, ``fsync`` it, ``os.replace`` it, sync the folder.

    The fsync before the rename is what makes it atomic on disk too: without it a crash after the
    rename can leave a 0-byte file under the new name (ext4/xfs delayed allocation). Rare writes
    only (a file per spike event, per ledger): a few milliseconds each.
    """
    with _replacing(Path(path)) as (fd, tmp):
        try:
            _write_all(tmp, fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)


def _sync_dir(folder: Path) -> None:
    """Make the rename itself durable; a file system that cannot sync a directory is left as it is."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextmanager
def atomic_file(path: str | Path, encoding: str = "utf-8") -> Iterator[IO[str]]:
    """A text file to write in pieces (e.g. a 10^6-entry blocklist, never held whole in memory): its
    content replaces ``path`` as ``atomic_write_bytes`` does, once the block ends without an error;
    an error (or a SIGTERM turned into ``SystemExit``) leaves ``path`` as it was and no temp file."""
    with _replacing(Path(path)) as (fd, _):
        with os.fdopen(fd, "w", encoding=encoding, newline="") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())


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
