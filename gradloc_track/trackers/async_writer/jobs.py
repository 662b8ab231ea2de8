"""Submitted jobs (artifact rendering) on the writer thread: what they log goes through a sink.

A job runs after everything queued before it; each call it makes is one record, delivered (or
spooled) like any other. A job that fails is reported and skipped: the writer keeps running, even
when the job raised a ``BaseException`` (a ``SystemExit`` deep in a plotting library).
"""
from __future__ import annotations

import contextlib
import threading
import warnings
from typing import Any, Callable, Iterable, Iterator

from ..interface import Tracker

#: where a sink's calls go: ``deliver(call, args, ts)``
Deliver = Callable[[str, tuple, int], Any]


class JobSink(Tracker):
    """What a submitted job logs through: each call goes to ``deliver(call, args, ts)`` in order."""

    def __init__(self, deliver: Deliver, ts: int) -> None:
        self._deliver, self._ts = deliver, ts

    def log_metrics(self, metrics, step):
        self._deliver("log_metrics", (dict(metrics), int(step)), self._ts)

    def log_table(self, key, columns, rows, step=None):
        self._deliver("log_table", (key, list(columns), [list(r) for r in rows], step), self._ts)

    def log_html(self, key, html, step=None):
        self._deliver("log_html", (key, html, step), self._ts)

    def log_image(self, key, path, step=None):
        self._deliver("log_image", (key, str(path), step), self._ts)

    def log_artifact(self, path, artifact_path=None):
        self._deliver("log_artifact", (str(path), artifact_path), self._ts)

    def set_tags(self, tags):
        self._deliver("set_tags", (dict(tags),), self._ts)


def run_job(job: Callable[[Tracker], None], sink: Tracker, name: str) -> None:
    try:
        job(sink)
    except Exception as exc:  # rendering an artifact failed: report, never crash the writer
        warnings.warn(f"gradloc-track: a background {name} job failed: {exc!r}", RuntimeWarning)
    except BaseException as exc:  # noqa: BLE001
        if threading.current_thread() is threading.main_thread():
            raise  # a job run in the caller's thread (after finish): Ctrl-C there is the user's
        warnings.warn(f"gradloc-track: a background {name} job failed: {exc!r}", RuntimeWarning)


def hurry(jobs: Iterable[Any]) -> None:
    """The caller waits (``flush()``, ``finish()``): each submitted job that can (``hurry()``: a spike's
    render, whose heatmap a low-priority process may still be drawing) finishes at once, at the caller's
    priority; the records queued behind it are not held past the call's bound. A job's own ``hurry()`` that
    fails is reported, never raised into the caller (``finish()`` always returns)."""
    for job in jobs:
        fn = getattr(job, "hurry", None)
        if callable(fn):
            try:
                fn()
            except Exception as exc:
                warnings.warn(f"gradloc-track: hurrying a background job failed: {exc!r}", RuntimeWarning)


class HurryGate:
    """The job the jobs thread runs now (``job``), and whether a caller waits (``flush()``; for good after
    ``finish()``).

    The waiting caller hurries the jobs it sees (queued, held, and ``job``); a job between those places (just
    taken off the queue, not yet running) is in none of them. So the jobs thread runs each job inside
    ``running(job)``, which marks it and then, while a caller waits, hurries it itself. The caller marks
    itself waiting before it looks, the jobs thread marks the job before it asks: one of the two always
    sees the other."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting = 0
        self._for_good = False
        self.job: Any = None  # the job running now (None between jobs)

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        with self._lock:
            self._waiting += 1
        try:
            yield
        finally:
            with self._lock:
                self._waiting -= 1

    def close(self) -> None:
        """``finish()``: every job from now on is waited for."""
        self._for_good = True

    @contextlib.contextmanager
    def running(self, job: Any) -> Iterator[None]:
        self.job = job
        try:
            if self._for_good or self._waiting:
                hurry([job])
            yield
        finally:
            self.job = None
