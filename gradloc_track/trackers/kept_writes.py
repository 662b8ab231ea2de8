"""The local run dir's writes that failed (a full disk), kept in memory and written when there is room.

``tracker=none`` writes the run's files into its run dir: on a full disk a spike's table, page
and heatmap used to be lost. A failed whole-file write is kept (its latest content, by path) and
written again once a later write shows there is room, and at ``finish()``; a metrics line that
cannot be appended waits in order, with every line after it, so ``metrics.jsonl`` stays in step
order. Up to ``MAX_BYTES`` are kept; past that a record is LOST (counted). What is still kept at
the end goes to a folder of its own (``rescue``), named in the closing lines, with the command
that puts it back. ``incomplete.RunDirWrites`` hears of every failure and every recovery.
"""
from __future__ import annotations

import collections
import tempfile
from pathlib import Path

from . import files
from .incomplete import RunDirWrites

MAX_BYTES = 64 << 20  # what a full disk may keep waiting in memory


class KeptWrites:
    def __init__(self, run_dir: Path, writes: RunDirWrites, metrics_name: str = "metrics.jsonl") -> None:
        self.run_dir, self.writes, self.metrics_name = run_dir, writes, metrics_name
        self.files: dict[str, bytes] = {}  # run-dir-relative path -> the content still to write
        self.lines: collections.deque[str] = collections.deque()  # metrics lines still to append, in order
        self.bytes = 0
        self.lost = 0  # records neither written nor kept (past MAX_BYTES)

    def file(self, rel: str, data: bytes) -> bool:
        """Write ``data`` as the file ``rel`` (atomically); kept on failure. True when written now."""
        try:
            files.atomic_write_bytes(self.run_dir / rel, data)
        except OSError as exc:
            self._keep_file(rel, data, exc)
            return False
        self._drop_file(rel)
        self.retry()  # there is room: what waits goes too
        return True

    def line(self, line: str) -> bool:
        """Append ``line`` to the metrics file after every line still waiting; True when written now."""
        if self.lines or not self._append(line):
            self._keep_line(line)
            return self.drain()
        self.retry()
        return True

    def retry(self) -> bool:
        """Every kept write, in order (lines, then files); True when nothing waits any more."""
        return self.drain() and self._retry_files()

    def drain(self) -> bool:
        done = 0
        while self.lines:
            if not self._append(self.lines[0]):
                return False
            self.bytes -= len(self.lines.popleft())
            done += 1
        self.writes.written(self.metrics_name, done)
        return True

    def _retry_files(self) -> bool:
        for rel, data in list(self.files.items()):
            try:
                files.atomic_write_bytes(self.run_dir / rel, data)
            except OSError:
                return False
            self._drop_file(rel)
        return True

    def _append(self, line: str) -> bool:
        try:
            files.append_line(self.run_dir / self.metrics_name, line)
        except OSError as exc:
            self.writes.failed(self.metrics_name, exc, kept=True)
            return False
        return True

    def _keep_file(self, rel: str, data: bytes, exc: OSError) -> None:
        old = len(self.files.get(rel, b""))
        if self.bytes - old + len(data) > MAX_BYTES:
            self.lost += 1
            self.writes.failed(rel, exc, kept=False)
            return
        self.files[rel] = data
        self.bytes += len(data) - old
        self.writes.failed(rel, exc, kept=True)

    def _drop_file(self, rel: str) -> None:
        data = self.files.pop(rel, None)
        if data is not None:
            self.bytes -= len(data)
            self.writes.written(rel)

    def _keep_line(self, line: str) -> None:
        if self.bytes + len(line) > MAX_BYTES:
            self.lost += 1
            self.writes.failed(self.metrics_name, OSError("kept lines past the memory bound were dropped"),
                               kept=False)
            return
        self.lines.append(line)
        self.bytes += len(line)

    def rescue(self) -> Path | None:
        """What still waits, written into a folder of its own (the system's temp dir, another disk as a
        rule), mirroring the run dir; its path, or None when nothing waits or it cannot be written."""
        if not self.files and not self.lines:
            return None
        try:
            folder = Path(tempfile.mkdtemp(prefix="gradloc-track-kept-"))
            for rel, data in self.files.items():
                files.atomic_write_bytes(folder / rel, data)
            if self.lines:  # the lines the run dir lacks, to append to its metrics file
                text = "".join(ln + "\n" for ln in self.lines)
                files.atomic_write_text(folder / f"{self.metrics_name}.missing", text)
        except OSError:
            return None
        return folder
