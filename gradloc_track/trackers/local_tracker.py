"""Writes the shared file layout into the run directory (``tracker=none`` with a run dir).

Also what ``gradloc-track report`` reads for runs logged nowhere. Every whole file is written
atomically (temp file + ``os.replace``): a kill mid-write leaves the old file or the new one.
``metrics.jsonl`` is append-only (a kill can only tear its last line, which readers skip); the
attribution table is one part per event (``<key>/step_<step>.json``), never rewritten.
A full disk or an unwritable run dir never raises into training: the record is counted in
``dropped`` (reported once in a warning, and as ``tracker/dropped`` in the next metrics line
that can be written); a line cut short by the full disk is taken back, so every line is a whole
record (``read_metrics``). The run directory is held for this run until ``finish()`` (``run_lock``).
"""
from __future__ import annotations

import json
import queue
import threading
import warnings
from pathlib import Path
from typing import Any, Callable, Mapping

from . import files, run_lock
from .interface import Tracker, final_status
from .bounded import clamp_wait
from .naming import DROPPED_KEY, step_path, table_part_path


def read_metrics(run_dir: str | Path, name: str = "metrics.jsonl") -> list[dict[str, Any]]:
    """Every whole ``{"step": s, "metrics": {...}}`` record of a run directory (a torn line is skipped)."""
    out = []
    for line in (Path(run_dir) / name).read_text(encoding="utf-8").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and "step" in rec:
            out.append(rec)
    return out


class LocalTracker(Tracker):
    name = "local"
    #: submitted jobs (artifact rendering) run on one background thread
    runs_jobs_off_thread = True

    def __init__(self, run_dir: str | Path, finish_timeout_s: float = 120.0,
                 owner: run_lock.RunOwner | None = None) -> None:
        self.run_dir = Path(run_dir)
        self._owner = owner or run_lock.RunOwner()
        run_lock.acquire(self.run_dir, self._owner)  # RunDirInUse: another run writes this directory
        self.finish_timeout_s = clamp_wait(finish_timeout_s)
        self.dropped = 0
        self._reported = 0
        self._error: str | None = None
        self._lock = threading.Lock()
        self._params: dict[str, Any] = {}
        self._tags: dict[str, str] = {}
        self._parts: dict[str, tuple[int | None, list[list[Any]]]] = {}  # key -> rows of its last step
        self._jobs: queue.Queue | None = None
        self._finished = False
        self._guard(lambda: self.run_dir.mkdir(parents=True, exist_ok=True))

    # -- every disk write goes through here: never raises, counts what was lost --------------
    def _guard(self, write: Callable[[], Any]) -> bool:
        try:
            write()
            return True
        except (OSError, ValueError, TypeError) as exc:
            with self._lock:
                self.dropped += 1
                first = self._error is None
                if first:
                    self._error = repr(exc)
            if first:
                warnings.warn(f"gradloc-track: cannot write to the run directory {self.run_dir} ({exc!r}); "
                              "training continues, records that cannot be written are LOST and counted in "
                              "tracker/dropped", RuntimeWarning, stacklevel=3)
            return False

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        metrics = dict(metrics)
        if self.dropped > self._reported:
            metrics[DROPPED_KEY] = float(self.dropped)
        line = json.dumps({"step": int(step), "metrics": metrics}, default=float)
        if self._guard(lambda: files.append_line(self.run_dir / "metrics.jsonl", line)):
            self._reported = int(metrics.get(DROPPED_KEY, self._reported))

    def log_params(self, params: Mapping[str, Any]) -> None:
        self._params.update({k: v if isinstance(v, (int, float, bool, type(None))) else str(v)
                             for k, v in params.items()})
        self._guard(lambda: files.atomic_write_json(self.run_dir / "params.json", self._params))

    def log_table(self, key, columns, rows, step=None) -> None:
        last_step, last_rows = self._parts.get(key, (None, []))
        rows = [list(r) for r in rows]
        if step is not None and step == last_step:  # a second call for the same event: one part
            rows = last_rows + rows
        self._parts[key] = (step, rows)
        part = {"columns": list(columns), "data": rows}
        self._guard(lambda: files.atomic_write_json(self.run_dir / table_part_path(key, step), part))

    def log_html(self, key, html, step=None) -> None:
        self._guard(lambda: files.atomic_write_text(self.run_dir / step_path(key, step, "html"), html))

    def log_image(self, key, path, step=None) -> None:
        dst = self.run_dir / step_path(key, step, "png")

        def copy() -> None:
            if Path(path).resolve() != dst.resolve():
                files.atomic_write_bytes(dst, Path(path).read_bytes())
        self._guard(copy)

    def log_artifact(self, path, artifact_path=None) -> None:
        dst = self.run_dir / "artifacts" / (artifact_path or "") / Path(path).name

        def copy() -> None:
            if Path(path).resolve() != dst.resolve():
                files.atomic_write_bytes(dst, Path(path).read_bytes())
        self._guard(copy)

    def set_tags(self, tags: Mapping[str, str]) -> None:
        self._tags.update({k: str(v) for k, v in tags.items()})
        self._guard(lambda: files.atomic_write_json(self.run_dir / "tags.json", self._tags))

    # -- background jobs (artifact rendering) --------------------------------------------------
    def submit(self, job) -> None:
        if self._finished:
            self._run_job(job)
            return
        if self._jobs is None:
            self._jobs = queue.Queue()
            threading.Thread(target=self._work, name="gradloc-track-local", daemon=True).start()
        self._jobs.put(job)

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                if job is None:
                    return
                self._run_job(job)
            finally:
                self._jobs.task_done()

    def _run_job(self, job) -> None:
        try:
            job(self)
        except Exception as exc:  # rendering failed: report, never crash
            warnings.warn(f"gradloc-track: writing a spike artifact failed: {exc!r}", RuntimeWarning)

    def flush(self, timeout_s: float | None = None) -> None:
        if self._jobs is not None:
            with self._jobs.all_tasks_done:
                self._jobs.all_tasks_done.wait_for(
                    lambda: self._jobs.unfinished_tasks == 0,
                    clamp_wait(self.finish_timeout_s if timeout_s is None else timeout_s, self.finish_timeout_s))

    def finish(self, status: str = "success", timeout_s: float | None = None) -> None:
        if self._finished:
            return
        from . import sigterm

        status = final_status(status)  # finish("failed") during a Ctrl-C: the run was killed
        sigterm.forget(self)
        self.flush(timeout_s)
        self._finished = True
        if self._jobs is not None:
            self._jobs.put(None)
        self.set_tags({"status": status})
        run_lock.release(self.run_dir, self._owner)
        if self.dropped:
            warnings.warn(f"gradloc-track: {self.dropped} record(s) could not be written to {self.run_dir} "
                          f"({self._error}) and are LOST", RuntimeWarning, stacklevel=2)
