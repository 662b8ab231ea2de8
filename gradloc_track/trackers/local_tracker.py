"""Writes the shared file layout into the run directory (``tracker=none`` with a run dir).

Also what ``gradloc-track report`` reads for runs logged nowhere. Every whole file is written
atomically (temp file + ``os.replace``): a kill mid-write leaves the old file or the new one.
``metrics.jsonl`` is append-only (a kill can only tear its last line, which readers skip); the
attribution table is one part per event (``<key>/step_<step>.json``), never rewritten.
A full disk or an unwritable run dir never raises into training: a write that fails is said on
stderr at once, the run dir marked ``INCOMPLETE`` (``incomplete``), and the record kept in memory
and written when there is room again (``kept_writes``: metrics lines in order, files by path); at
``finish()`` what still waits goes to a folder of its own and the closing lines say where and how
to put it back. Only past the memory bound is a record LOST: counted in ``dropped`` (and as
``tracker/dropped`` in the next metrics line written). A line cut short by the full disk is taken
back, so every line is a whole record (``read_metrics``). The run directory is held for this run
until ``finish()`` (``run_lock``).
"""
from __future__ import annotations

import json
import queue
import threading
import warnings
from pathlib import Path
from typing import Any, Callable, Mapping

from .table_json import dumps_table
from . import run_lock
from .interface import Tracker, final_status
from .bounded import clamp_wait
from .incomplete import say, writes_of
from .kept_writes import KeptWrites
from .async_writer.jobs import HurryGate, hurry
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


def metrics_by_step(run_dir: str | Path, name: str = "metrics.jsonl") -> dict[int, dict[str, Any]]:
    """``metrics.jsonl`` as step -> every metric logged at that step: one line is one log call, and a step can
    have several (a spike step's ``spike/culprit*`` metrics come in a line of their own; a new user, stop 55,
    read it by step and lost the other line's keys)."""
    out: dict[int, dict[str, Any]] = {}
    for rec in read_metrics(run_dir, name):
        out.setdefault(int(rec["step"]), {}).update(rec.get("metrics") or {})
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
        self._unwritable = 0  # records that could not even be encoded
        self._reported = 0
        self._error: str | None = None
        self._lock = threading.Lock()  # the training thread and the jobs thread both write
        self._writes = writes_of(self.run_dir)
        self._kept = KeptWrites(self.run_dir, self._writes)
        self._params: dict[str, Any] = {}
        self._tags: dict[str, str] = {}
        self._parts: dict[str, tuple[int | None, list[list[Any]]]] = {}  # key -> rows of its last step
        self._jobs: queue.Queue | None = None
        self._gate = HurryGate()  # the job running on the jobs thread; flush() and finish() hurry it
        self._finished = False
        self._guard(lambda: self.run_dir.mkdir(parents=True, exist_ok=True))

    @property
    def dropped(self) -> int:
        """Records LOST: neither written nor kept (past the memory bound, or not encodable)."""
        return self._kept.lost + self._unwritable

    # -- every disk write goes through here: never raises; a failed write is kept for later ------
    def _guard(self, write: Callable[[], Any]) -> bool:
        """``write()`` under the lock; an error that is no disk write's (a value that cannot be encoded) is
        counted as LOST and said once."""
        try:
            with self._lock:
                return bool(write())
        except (OSError, ValueError, TypeError) as exc:
            with self._lock:
                self._unwritable += 1
                first = self._error is None
                if first:
                    self._error = repr(exc)
            if first:
                warnings.warn(f"gradloc-track: cannot write a record to the run directory {self.run_dir} ({exc!r}); "
                              "training continues, records that cannot be written are LOST and counted in "
                              "tracker/dropped", RuntimeWarning, stacklevel=3)
            return False

    def _file(self, rel: str, data: Callable[[], bytes]) -> None:
        self._guard(lambda: self._kept.file(rel, data()))

    def _json(self, rel: str, obj: Any) -> None:
        self._file(rel, lambda: json.dumps(obj, default=str).encode("utf-8"))

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        metrics = dict(metrics)
        if self.dropped > self._reported:
            metrics[DROPPED_KEY] = float(self.dropped)
        line = json.dumps({"step": int(step), "metrics": metrics}, default=float)
        if self._guard(lambda: self._kept.line(line)):
            self._reported = int(metrics.get(DROPPED_KEY, self._reported))

    def log_params(self, params: Mapping[str, Any]) -> None:
        self._params.update({k: v if isinstance(v, (int, float, bool, type(None))) else str(v)
                             for k, v in params.items()})
        self._json("params.json", self._params)

    def log_table(self, key, columns, rows, step=None) -> None:
        last_step, last_rows = self._parts.get(key, (None, []))
        rows = [list(r) for r in rows]
        if step is not None and step == last_step:  # a second call for the same event: one part
            rows = last_rows + rows
        self._parts[key] = (step, rows)
        self._file(table_part_path(key, step), lambda: dumps_table(columns, rows).encode("utf-8"))

    def log_html(self, key, html, step=None) -> None:
        self._file(step_path(key, step, "html"), lambda: html.encode("utf-8"))

    def log_image(self, key, path, step=None) -> None:
        self._copy(path, step_path(key, step, "png"))

    def log_artifact(self, path, artifact_path=None) -> None:
        self._copy(path, str(Path("artifacts") / (artifact_path or "") / Path(path).name))

    def _copy(self, path: str | Path, rel: str) -> None:
        """A file into the run dir (its bytes read now: a staging file may go)."""
        if Path(path).resolve() != (self.run_dir / rel).resolve():
            self._file(rel, lambda: Path(path).read_bytes())

    def set_tags(self, tags: Mapping[str, str]) -> None:
        self._tags.update({k: str(v) for k, v in tags.items()})
        self._json("tags.json", self._tags)

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
                with self._gate.running(job):
                    self._run_job(job)
            finally:
                self._jobs.task_done()

    def _run_job(self, job) -> None:
        try:
            job(self)
        except Exception as exc:  # rendering failed: report, never crash
            warnings.warn(f"gradloc-track: writing a spike artifact failed: {exc!r}", RuntimeWarning)

    def flush(self, timeout_s: float | None = None) -> None:
        """Wait for the submitted jobs; the caller waits, so they are hurried (``jobs.hurry``: a spike's
        heatmap is drawn on the jobs thread now, not in the low-priority worker)."""
        if self._jobs is not None:
            with self._gate.waiting():
                with self._jobs.mutex:
                    waiting = [self._gate.job, *self._jobs.queue]
                hurry(waiting)
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
        self._gate.close()
        self.flush(timeout_s)
        self._finished = True
        if self._jobs is not None:
            self._jobs.put(None)
        self.set_tags({"status": status})
        self._settle()
        run_lock.release(self.run_dir, self._owner)
        if self._unwritable:
            warnings.warn(f"gradloc-track: {self._unwritable} record(s) could not be written to {self.run_dir} "
                          f"({self._error}) and are LOST", RuntimeWarning, stacklevel=2)

    def _settle(self) -> None:
        """The last try at what waits in memory; what still cannot go into the run dir goes to a folder of
        its own; the closing lines say what happened."""
        with self._lock:
            if not self._kept.retry():
                self._writes.rescued_to = self._kept.rescue()
                if self._writes.rescued_to is None:  # nowhere to keep it: lost
                    for rel in list(self._writes.pending):
                        self._writes.failed(rel, OSError("nowhere to keep it"), kept=False)
        self._writes.settle()
        say(self._writes.closing_lines())
