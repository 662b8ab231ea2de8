"""Fixtures of the tracker tests."""
from __future__ import annotations

import contextlib
import errno
import os
import subprocess

import pytest

from gradloc_track.trackers import files


@pytest.fixture
def full_disk(tmp_path, monkeypatch, temp_root):
    """A directory on a full disk: a tiny tmpfs filled up when we may mount one, else ENOSPC
    injected in our write functions. Yields (dir, free) where ``free()`` makes room again. The
    system's temp dir, where what finds no room is kept by design, is the test's own (``temp_root``)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = os.geteuid() == 0 and subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(disk)],
                                                   capture_output=True).returncode == 0
    if mounted:
        filler = disk / "filler"
        for chunk in (4096, 1):  # pages, then whatever a partial page still holds
            with open(filler, "ab", buffering=0) as f, contextlib.suppress(OSError):
                while True:
                    f.write(b"\0" * chunk)

        def free():
            filler.unlink()
    else:
        state = {"full": True}
        real_append, real_write = files.append_line, files.atomic_write_bytes

        def failing(real):
            def write(path, data):
                if state["full"] and str(path).startswith(str(disk)):
                    raise OSError(errno.ENOSPC, "No space left on device (injected)", str(path))
                return real(path, data)
            return write
        monkeypatch.setattr(files, "append_line", failing(real_append))
        monkeypatch.setattr(files, "atomic_write_bytes", failing(real_write))

        def free():
            state["full"] = False
    yield disk, free
    if mounted:
        subprocess.run(["umount", "-l", str(disk)], check=False)


PAGE = 4096


class TightDisk:
    """A directory (``dir``) on a small disk: ``fill()`` leaves room for one more page (4 KiB), so the
    write that crosses it is cut short (a torn line) and later ones fail with ENOSPC, until ``free()``.
    A real tmpfs when we may mount one, else the same partial writes injected where our file
    functions write bytes."""

    def __init__(self, root, monkeypatch) -> None:
        self.dir = root / "tight"
        self.dir.mkdir()
        self.mounted = os.geteuid() == 0 and subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(self.dir)], capture_output=True).returncode == 0
        self._room = {"left": 1 << 40}
        if not self.mounted:
            real = files._write_all

            def partial(path, fd, data):
                if not str(path).startswith(str(self.dir)):
                    return real(path, fd, data)
                if len(data) > self._room["left"]:
                    os.write(fd, bytes(data[: self._room["left"]]))
                    self._room["left"] = 0
                    raise OSError(errno.ENOSPC, "No space left on device (injected)", str(path))
                self._room["left"] -= len(data)
                return real(path, fd, data)
            monkeypatch.setattr(files, "_write_all", partial)

    def fill(self) -> None:
        if not self.mounted:
            self._room["left"] = PAGE
            return
        filler = self.dir / "filler"
        with open(filler, "ab", buffering=0) as f, contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * PAGE)
        os.truncate(filler, filler.stat().st_size - PAGE)  # one page free

    def free(self) -> None:
        if self.mounted:
            (self.dir / "filler").unlink()
        self._room["left"] = 1 << 40


@pytest.fixture
def tight_disk(tmp_path, monkeypatch, temp_root):
    """A ``TightDisk``; what finds no room is kept, by design, in the temp dir: the test's own (``temp_root``)."""
    disk = TightDisk(tmp_path, monkeypatch)
    yield disk
    if disk.mounted:
        subprocess.run(["umount", "-l", str(disk.dir)], check=False)
