"""One run per run directory: the run that writes ``<run dir>`` holds ``<run dir>/tracker/owner.lock``.

Two runs in one directory would share one spool (replay would write two values per step) and one
run record (the report would open either). So every writer of a run directory (the background
writer of each backend, ``LocalTracker``, ``replay``) takes the lock for its run; the trackers of
ONE run (``tracker=both``, a joined MLflow and W&B run) share it through one ``RunOwner``. A
second run gets ``RunDirInUse`` at once, naming the process that holds the directory.

The lock is an ``flock`` on the file (POSIX): the kernel drops it when the process dies, even on
``kill -9``, so a free lock with no final status recorded means the run's process is gone
(``replay`` then ends the run as KILLED). The file stays (deleting a lock file races with the next
opener); it holds the owner's pid, host and start time, for the message. Without ``fcntl``
(Windows) only runs of the same process are kept apart.

A run directory we made ourselves (a temporary one, for a run the user gave no directory) is
removed when its run ends, unless it holds a spool (records for ``gradloc-track replay``).
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

LOCK_NAME = "owner.lock"


class RunDirInUse(RuntimeError):
    """Another run (another process, or an unfinished run of this one) writes this run directory."""


class RunOwner:
    """The run the trackers sharing it belong to (one lock, released when the last one finishes)."""

    def __init__(self, temporary: bool = False) -> None:
        self.temporary = temporary  # the directory is ours to remove when the run ends


@dataclass
class _Held:
    owner: RunOwner
    fd: int
    users: int = 1
    since: float = field(default_factory=time.time)


_held: dict[Path, _Held] = {}
_lock = threading.Lock()


def lock_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / "tracker" / LOCK_NAME


def _key(run_dir: str | Path) -> Path:
    return Path(run_dir).resolve()


def acquire(run_dir: str | Path, owner: RunOwner) -> None:
    """Hold ``run_dir`` for ``owner``'s run; ``RunDirInUse`` when another run holds it."""
    key = _key(run_dir)
    with _lock:
        held = _held.get(key)
        if held is not None:
            if held.owner is not owner:
                raise RunDirInUse(_in_use(run_dir, f"a run of this process (pid {os.getpid()}) that has not "
                                                   "finished yet"))
            held.users += 1
            return
        _held[key] = _Held(owner, _lock_file(run_dir))


def release(run_dir: str | Path, owner: RunOwner) -> None:
    """One of ``owner``'s trackers is done; the last one frees the directory (and removes a temporary one)."""
    key = _key(run_dir)
    with _lock:
        held = _held.get(key)
        if held is None or held.owner is not owner:
            return
        held.users -= 1
        if held.users > 0:
            return
        del _held[key]
        if held.fd >= 0:
            os.close(held.fd)  # drops the flock
    if owner.temporary and not _has_spool(Path(run_dir)):
        shutil.rmtree(run_dir, ignore_errors=True)


def owner_alive(run_dir: str | Path) -> bool:
    """True while some run (this process's or another's) holds ``run_dir``."""
    if _key(run_dir) in _held:
        return True
    path = lock_path(run_dir)
    if fcntl is None or not path.exists():
        return False
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)  # (unlocks when we got it)
    return False


def _lock_file(run_dir: str | Path) -> int:
    """The locked file's descriptor; -1 when the directory cannot hold one (unwritable: nothing else
    of the run can be written there either, and training must not stop for it)."""
    path = lock_path(run_dir)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError:
        return -1
    if fcntl is not None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise RunDirInUse(_in_use(run_dir, _describe_owner(path))) from None
    who = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(who).encode(), 0)
    except OSError:  # a full disk: the lock holds all the same; only the message loses its details
        pass
    return fd


def _describe_owner(path: Path) -> str:
    try:
        who = json.loads(path.read_text(encoding="utf-8"))
        return f"pid {who['pid']} on {who['host']}, started {who['started']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process"


def _in_use(run_dir: str | Path, by: str) -> str:
    return (f"run directory {run_dir} is in use by {by}: one run per run directory (two runs would share one "
            "spool and one run record). Use another run directory (Hydra: hydra.run.dir=...; watch(): run_dir=...), "
            "or finish() the other run first")


def _has_spool(run_dir: Path) -> bool:
    spool = run_dir / "spool"
    return spool.is_dir() and any(p.stat().st_size > 0 for p in spool.glob("*.jsonl"))
