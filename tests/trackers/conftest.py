"""Fixtures of the tracker tests."""
from __future__ import annotations

import contextlib
import errno
import os
import subprocess

import pytest

from gradloc_track.trackers import files


@pytest.fixture
def full_disk(tmp_path, monkeypatch):
    """A directory on a full disk: a tiny tmpfs filled up when we may mount one, else ENOSPC
    injected in our write functions. Yields (dir, free) where ``free()`` makes room again."""
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
