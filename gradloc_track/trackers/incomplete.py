"""A run dir some write could not complete (a full disk, a file-size limit, a folder made read-only).

Such a run used to end as if all was well: exit 0, nothing on stderr, a spike's table never
written, a 0-byte heatmap; ``report`` then wrote an empty page and ``culprits`` counted 0 spike
events, both with exit 0. Now every writer of a run dir (the local tracker, the spool, the run
record) tells ``RunDirWrites`` what it could not write:

- at the first failure, at once, one message on stderr (whatever the warning filters);
- the run dir gets ``INCOMPLETE``: created empty (a name needs no data block, so it can be made on
  a full disk), then a line per failed file while there is room. ``report`` and ``culprits`` read
  it (``incomplete_reason``) and say the run dir is incomplete, with a non-zero exit;
- at ``finish()`` the closing lines say what is still missing, where it was kept
  (``rescued_to``) and how to put it back; when everything was written after all (the disk had
  room again), the marker is removed and the closing line says so.
"""
from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

MARKER = "INCOMPLETE"
LISTED = 5  # files named in the closing lines (the rest counted)


class RunDirWrites:
    """What could not be written into one run dir (thread-safe: the writer and training threads)."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self._lock = threading.Lock()
        self.pending: dict[str, str] = {}  # kept in memory, retried: what -> why it failed
        self.lost: dict[str, str] = {}  # never written (or only to the rescue folder): what -> why
        self.first_error: str | None = None
        self.rescued_to: Path | None = None
        self.recovered = 0  # kept writes that made it after all
        self._said: tuple | None = None  # what the last closing lines covered (trackers of one run share them)

    @property
    def incomplete(self) -> bool:
        return bool(self.pending or self.lost)

    def failed(self, what: str, exc: BaseException, kept: bool) -> None:
        """``what`` (a path in the run dir) could not be written; ``kept``: it waits in memory for a retry."""
        why = _why(exc)
        with self._lock:
            first = self.first_error is None
            if first:
                self.first_error = why
            new = what not in self.pending and what not in self.lost
            (self.pending if kept else self.lost)[what] = why
            if not kept:
                self.pending.pop(what, None)
        if first:  # (what happens to it: kept for a retry, or, a spool's, lost: held-out tester, stop 54, read
            # "kept in memory" and then "LOST" about the same records)
            fate = ("what cannot be written is kept in memory and written when there is room again (or at the end "
                    "into a folder of its own, named then)") if kept else (
                    f"what {what} would have held is LOST while there is no room (the closing lines count it)")
            say([f"gradloc-track: cannot write {what} into the run dir {self.run_dir} ({why}): the run dir is "
                 f"INCOMPLETE from here on. Training continues; {fate}; 'gradloc-track report' and 'culprits' will "
                 "say the run dir is incomplete."])
        if new:
            self._mark(f"{what}: {why}\n")

    def written(self, what: str, records: int = 1) -> None:
        """A kept write made it (``records``: how many records it held)."""
        with self._lock:
            if self.pending.pop(what, None) is not None:
                self.recovered += records

    def _mark(self, line: str) -> None:
        """``INCOMPLETE`` exists (made empty first: it needs no data block), then ``line`` in it if there is room."""
        try:
            fd = os.open(self.run_dir / MARKER, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o666)
        except OSError:
            return
        try:
            os.write(fd, line.encode("utf-8", "replace"))
        except OSError:
            pass
        finally:
            os.close(fd)

    def settle(self) -> None:
        """At the end: everything was written after all, so the run dir is whole (the marker goes)."""
        if not self.incomplete and self.first_error is not None:
            try:
                os.unlink(self.run_dir / MARKER)
            except OSError:
                pass

    def closing_lines(self) -> list[str]:
        """What the run's closing lines say about its run dir (nothing when no write ever failed, or when
        another tracker of the run said the same already)."""
        state = (tuple(sorted(self.pending)), tuple(sorted(self.lost)), self.rescued_to, self.recovered)
        if self.first_error is None or state == self._said:
            return []
        self._said = state
        if not self.incomplete:
            return [f"gradloc-track: the run dir {self.run_dir} had no room for a while ({self.first_error}); the "
                    f"{self.recovered} record(s) that waited in memory were all written by the end: it is complete"]
        missing = {**self.lost, **self.pending}
        names = ", ".join(sorted(missing)[:LISTED]) + (f" (+{len(missing) - LISTED} more)" if len(missing) > LISTED
                                                       else "")
        lines = [f"gradloc-track: the run dir {self.run_dir} is INCOMPLETE ({self.first_error}): {len(missing)} "
                 f"file(s) could not be written there: {names}."]
        if self.rescued_to is not None:
            missing_lines = self.rescued_to / "metrics.jsonl.missing"
            lines.append(f"  They are kept in {self.rescued_to}; once there is room, put them back with:")
            if missing_lines.is_file():
                lines.append(f"    cat {missing_lines} >> {self.run_dir / 'metrics.jsonl'}")
            lines.append(f"    cp -rn {self.rescued_to}/. {self.run_dir}/ && rm {self.run_dir / MARKER}")
        else:
            lines.append("  They are LOST. 'gradloc-track report' and 'culprits' say the run dir is incomplete.")
        return lines


_dirs: dict[Path, RunDirWrites] = {}
_dirs_lock = threading.Lock()


def writes_of(run_dir: str | Path) -> RunDirWrites:
    """The one ``RunDirWrites`` of ``run_dir`` in this process."""
    key = Path(os.path.abspath(run_dir))
    with _dirs_lock:
        if key not in _dirs:
            _dirs[key] = RunDirWrites(Path(run_dir))
        return _dirs[key]


def incomplete_reason(run_dir: str | Path) -> str | None:
    """Why a run dir is incomplete (its ``INCOMPLETE`` says), for the readers; None when it is not marked."""
    path = Path(run_dir) / MARKER
    if not path.is_file():
        return None
    try:
        lines = [ln for ln in path.read_text(encoding="utf-8", errors="replace").splitlines() if ln.strip()]
    except OSError:
        lines = []
    what = f"{len(lines)} file(s) could not be written, the first: {lines[0]}" if lines else \
        "a write failed while the run ran (a full disk?)"
    return (f"the run dir {run_dir} is INCOMPLETE: {what}. What it holds is not the whole run (see {MARKER} in "
            "it; the run's closing lines said where the rest was kept)")


def write_run_file(run_dir: str | Path, name: str, text: str) -> Path | None:
    """An app's own file (``config.yaml``, ``summary.json``) into the run dir, atomically; where the run
    dir has no room, into a folder of its own in the system's temp dir (same name: a tracker logs it
    as it would have), the failure said and marked. Its path; None when it could be written nowhere.
    Never raises: a full disk must not end the run at its last step."""
    import tempfile

    from .files import atomic_write_text

    path = Path(run_dir) / name
    try:
        atomic_write_text(path, text)
        return path
    except OSError as exc:
        writes_of(run_dir).failed(name, exc, kept=False)
    try:
        other = Path(tempfile.mkdtemp(prefix="gradloc-track-kept-")) / name
        atomic_write_text(other, text)
    except OSError:
        return None
    say([f"gradloc-track: {name} is kept in {other} instead"])
    return other


def _why(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return repr(exc)


def say(lines: list[str]) -> None:
    """On stderr, now (whatever the warning filters: a full disk must never pass unsaid)."""
    if lines:
        print("\n".join(lines), file=sys.stderr, flush=True)
