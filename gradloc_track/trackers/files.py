"""Crash-safe local file writes: a reader sees the old file or the new one, never half of one."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write ``data`` to a temp file beside ``path``, then ``os.replace`` it (atomic on POSIX).

    A killed process leaves the old file or the new one. No fsync: that guards against power
    loss, not process death, and costs milliseconds per call on the training thread.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
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
    """Append one line; a kill mid-write can only tear the LAST line, which readers skip."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(line + "\n")
