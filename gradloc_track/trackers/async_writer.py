"""Logging that never blocks or kills training: a bounded queue and a background writer.

The training thread only enqueues. A writer thread builds the backend (so an unreachable
server cannot stall start-up), merges queued metrics into batches, and calls the backend. A
call that raises is retried with backoff; if it still fails, the record goes to the spool file
``<run_dir>/spool/<backend>.jsonl`` with a warning. Nothing is dropped silently: records that
do not fit in a full queue are spooled directly. ``flush()`` waits; ``finish()`` drains.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Mapping

from .base import Tracker
from .spool import Spool

log = logging.getLogger(__name__)
_STOP = object()


class AsyncTracker(Tracker):
    def __init__(self, factory: Callable[[], Tracker], name: str, run_dir: str | Path,
                 queue_size: int = 10000, flush_interval_s: float = 1.0, retries: int = 3,
                 retry_backoff_s: float = 0.5, put_timeout_s: float = 0.05) -> None:
        self.name = name
        self.run_dir = Path(run_dir)
        self.spool = Spool(self.run_dir / "spool" / f"{name}.jsonl", name)
        self._factory = factory
        self._inner: Tracker | None = None
        self._broken: str | None = None  # why the backend could not be built
        self._q: queue.Queue = queue.Queue(maxsize=queue_size)
        self._flush_interval = flush_interval_s
        self._retries = retries
        self._backoff = retry_backoff_s
        self._put_timeout = put_timeout_s
        self._failing = 0  # consecutive failed calls: stop retrying while the backend is down
        self._warned = False
        self._finished = False
        self._thread = threading.Thread(target=self._run, name=f"gradloc-track-{name}", daemon=True)
        self._thread.start()

    # -- producer side (training thread) -------------------------------------------------
    def _put(self, call: str, *args: Any) -> None:
        if self._finished:
            raise RuntimeError(f"tracker {self.name!r} is finished; create a new one for a new run")
        try:
            self._q.put((call, args), timeout=self._put_timeout)
        except queue.Full:  # never block training: keep the record in the spool instead
            self._spill(call, args, "queue full (backend too slow)")

    def log_metrics(self, metrics, step):
        self._put("log_metrics", dict(metrics), int(step))

    def log_params(self, params):
        self._put("log_params", dict(params))

    def log_table(self, key, columns, rows, step=None):
        self._put("log_table", key, list(columns), [list(r) for r in rows], step)

    def log_html(self, key, html, step=None):
        self._put("log_html", key, html, step)

    def log_image(self, key, path, step=None):
        self._put("log_image", key, str(path), step)

    def log_artifact(self, path, artifact_path=None):
        self._put("log_artifact", str(path), artifact_path)

    def set_tags(self, tags):
        self._put("set_tags", dict(tags))

    def flush(self) -> None:
        """Block until everything queued so far has been written (or spooled)."""
        if not self._finished:
            self._q.join()

    def finish(self, status: str = "success", timeout_s: float = 300.0) -> None:
        if self._finished:
            return
        self._q.put(("finish", (status,)))
        self._q.put((_STOP, ()))
        self._finished = True
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            warnings.warn(f"gradloc-track: the {self.name} writer did not finish within {timeout_s:.0f} s; "
                          f"records still queued will be lost unless the process stays up")

    # -- consumer side (writer thread) ---------------------------------------------------
    def _run(self) -> None:
        pending: dict[int, dict[str, float]] = {}  # step -> merged metrics
        last = time.monotonic()
        while True:
            try:
                call, args = self._q.get(timeout=self._flush_interval)
            except queue.Empty:
                self._write_metrics(pending)
                last = time.monotonic()
                continue
            try:
                if call is _STOP:
                    self._write_metrics(pending)
                    return
                if call == "log_metrics":
                    pending.setdefault(args[1], {}).update(args[0])
                    if time.monotonic() - last >= self._flush_interval or len(pending) >= 256:
                        self._write_metrics(pending)
                        last = time.monotonic()
                else:  # keep order: metrics queued before this record go first
                    self._write_metrics(pending)
                    self._call(call, args)
                if self._q.qsize() == 0:  # flush() must not return with metrics held back
                    self._write_metrics(pending)
            finally:
                self._q.task_done()

    def _write_metrics(self, pending: dict[int, dict[str, float]]) -> None:
        for step in sorted(pending):
            self._call("log_metrics", (pending[step], step))
        pending.clear()

    def _backend(self) -> Tracker | None:
        if self._inner is None and self._broken is None:
            try:
                self._inner = self._retry(self._factory)
            except Exception as exc:
                self._broken = f"could not start the {self.name} backend: {exc!r}"
                self._warn(self._broken)
        return self._inner

    def _retry(self, fn: Callable[[], Any]) -> Any:
        tries = 1 if self._failing >= 2 else self._retries + 1
        for attempt in range(tries):
            try:
                out = fn()
                self._failing = 0
                return out
            except Exception:
                if attempt == tries - 1:
                    self._failing += 1
                    raise
                time.sleep(self._backoff * (2 ** attempt))

    def _call(self, call: str, args: tuple) -> None:
        inner = self._backend()
        if inner is None:
            self._spill(call, args, self._broken or "backend unavailable")
            return
        try:
            self._retry(lambda: getattr(inner, call)(*args))
        except Exception as exc:
            self._spill(call, args, repr(exc))

    def _spill(self, call: str, args: tuple, error: str) -> None:
        self.spool.write(call, args, error)
        self._warn(error)

    def _warn(self, error: str) -> None:
        if not self._warned:  # once per tracker; the spool file holds every record
            self._warned = True
            warnings.warn(f"gradloc-track: the {self.name} tracker failed ({error}); records are kept in "
                          f"{self.spool.path} (replay with gradloc_track.trackers.replay_spool)",
                          RuntimeWarning, stacklevel=2)
            log.warning("%s tracker failing (%s); spooling to %s", self.name, error, self.spool.path)
