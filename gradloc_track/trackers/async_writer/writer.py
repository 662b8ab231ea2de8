"""The writer thread: records off the queue in order, metrics merged per step and written ACROSS
steps, each backend call bounded by ``call_timeout_s``, else spooled.

When metrics are written (a step of metrics never wakes this thread):
- every ``flush_interval_s``: everything pending, in as few requests as the backend takes;
- when a request is full (the backend's ``max_metrics_per_request`` values, or ``MAX_PENDING_STEPS``
  steps): the full requests at once, the rest at the interval;
- ahead of any other record (order is kept: a table, tag or job waits, held, until the metrics
  queued before it are written), on ``flush()`` (its ``FLUSH`` record is done only once they are
  written) and at ``finish()``.
So a run logging every step sends one request per interval (or per full batch), not one per step:
each request is a burst of the SDK's work (an MLflow ``log_batch`` into SQLite is ~10 ms of Python
before its first metric), and bursts that run beside training take the GIL from it.

Batches: a backend that names its ``max_metrics_per_request`` (MLflow's ``log_batch`` takes many
metrics, each with its step; the W&B adapter logs the steps one by one inside one call) gets the
pending steps in ONE ``log_metric_records`` call, in step order, up to that many values. While a
slow request is in flight the next steps pile up in pending and go together in the next one, so a
server slower than training still receives every step while training runs. Other backends get one
call per step, together.

Nothing a backend raises kills this thread: ``BaseException``s come back from the call thread
as ``CallAborted`` (a failed call: down, spooled), and the loop guards the rest.
"""
from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable

from ..interface import ARTIFACT_CALLS, Tracker, send
from ..bounded import MAX_WAIT_S, CallThread, bounded_call
from ..naming import DROPPED_KEY
from ..run_record import update_run_record
from .health import BackendHealth
from .jobs import HurryGate, JobSink, run_job
from .opener import BackendSource, LazyBackend
from .pending import FLUSH, STOP, PendingRecords
from .settings import WriterSettings
from .spill import Spill

MAX_PENDING_STEPS = 256  # merged steps that make a full request whatever the backend
MAX_METRICS_PER_REQUEST = 1000  # a request's size when the backend names none
# For a backend whose artifact store is apart (``Tracker.artifacts_apart``: MLflow), ``ARTIFACT_CALLS``
# (``interface``) run on a call thread of their own, and one that fails or times out (a read-only folder; a server
# answering 500, which the SDK retries for minutes) takes down the artifact store alone: its records wait in the
# spool while the metrics go on (held-out tester, stop 64: a read-only artifact folder kept all 130 steps' metrics
# out of MLflow and the run RUNNING). Elsewhere any failure takes the whole backend down, as before.


class WriterLoop:
    def __init__(self, source: BackendSource, q: queue.Queue, pending: PendingRecords, spill: Spill,
                 settings: WriterSettings) -> None:
        self.name, self.run_dir, self.q, self.pending, self.spill = source.name, source.run_dir, q, pending, spill
        self.flush_interval_s, self.call_timeout_s = settings.flush_interval_s, settings.call_timeout_s
        self.retries, self.retry_backoff_s = settings.retries, settings.retry_backoff_s
        self.calls = CallThread(f"gradloc-track-{self.name}-call")
        self.health = BackendHealth(self.name, settings.probe_interval_s, spill.spool.path)
        self.artifact_health = BackendHealth(self.name, settings.probe_interval_s, spill.spool.path,
                                             label=f"{self.name} artifact store")
        self.artifact_calls: CallThread | None = None  # ARTIFACT_CALLS of a backend whose store is apart
        self.backend = LazyBackend(source, self.calls, settings)
        #: set by the producer when this thread must not wait for the interval (flush, finish, a full
        #: batch, a record that is not metrics); a step of metrics alone never sets it
        self.wake = threading.Event()
        #: values in one full request (the backend's own limit once it is open)
        self.batch_values = MAX_METRICS_PER_REQUEST
        self.status_handled = False  # the final status reached the backend or the spool
        self.delivered = 0  # records the backend took
        self._due = 0.0  # when pending metrics are written (the first ones at once: they open the run)
        self._last_step = 0
        self._reported_dropped = 0
        self.gate = HurryGate()  # the submitted job running now; flush() and finish() hurry it

    @property
    def dropped(self) -> int:
        return self.spill.spool.dropped

    # -- the loop --------------------------------------------------------------------------------
    def run(self) -> None:
        while True:
            self.wake.wait(self._wait_s())
            self.wake.clear()  # (before draining: a record queued from here on wakes the next wait)
            if self._drain():
                return
            if self.pending.abandoned is not None:
                return  # finish() took over: everything left is in the spool
            self._guard(self._write_metrics, time.monotonic() >= self._due)

    def _wait_s(self) -> float:
        if not len(self.pending):
            return self.flush_interval_s
        return min(max(0.0, self._due - time.monotonic()), MAX_WAIT_S)

    def _drain(self) -> bool:
        """Take every record queued now, in order; ``True`` when the last one was ``STOP``."""
        while True:
            try:
                call, args, ts = self.q.get_nowait()
            except queue.Empty:
                return False
            try:
                if call is STOP:
                    self._guard(self._write_metrics, True)
                    return True
                self._take(call, args, ts)
            finally:
                self.q.task_done()

    def _take(self, call: Any, args: tuple, ts: int) -> None:
        if call == "log_metrics":
            self._guard(self._merge, args, ts)
            self._guard(self._write_metrics, False)  # (only requests that are full)
        elif call is FLUSH:
            self._guard(self._write_metrics, True)
        else:  # keep order: metrics queued before this record go first
            self.pending.hold((call, args, ts))
            self._guard(self._write_metrics, True)
            if self.pending.unhold() is not None:  # None: finish() gave up meanwhile and spooled it in order
                self._guard(self._handle, call, args, ts)

    def _guard(self, fn: Callable, *args: Any) -> None:
        """The writer thread never dies: an unexpected error (any ``BaseException``) is reported once and skipped."""
        try:
            fn(*args)
        except BaseException as exc:  # noqa: BLE001 - not even SystemExit: this thread is ours, not the user's
            self.spill.warn_once("writer", f"gradloc-track: the {self.name} writer hit an unexpected error "
                                 f"({exc!r}); it keeps running")

    def _merge(self, args: tuple, ts: int) -> None:
        metrics, step = args
        if not self.pending.merge(metrics, step, ts):
            self.spill("log_metrics", args, ts, self.pending.abandoned)

    def _full(self) -> bool:
        """The pending metrics fill a request (``- 1``: room for ``tracker/dropped`` in the same one)."""
        return len(self.pending) >= MAX_PENDING_STEPS or self.pending.values >= self.batch_values - 1

    def _write_metrics(self, everything: bool) -> None:
        """Pending metrics to the backend: all of them (``everything``: due, flushed, or ahead of another
        record), else only full requests. What is not yet in flight stays visible to finish()'s hand-over."""
        wrote = False
        while len(self.pending) and (everything or self._full()):
            inner = self.backend.inner  # (None until opened: the first write opens it)
            if inner is not None and inner.max_metrics_per_request:
                record = self.pending.pop_batch(self.batch_values - 1)
            else:  # one call per step: a full set of steps goes at once
                record, everything = self.pending.pop_first(), True
            if record is not None:
                self.deliver(*record)
                wrote = True
        if wrote and everything:
            self._due = time.monotonic() + self.flush_interval_s

    def _handle(self, call: str, args: tuple, ts: int) -> None:
        if call == "submit":
            with self.gate.running(args[0]):
                run_job(args[0], JobSink(self.deliver, ts), self.name)
        elif call == "finish":
            self._finish_backend(args[0], ts)
        else:
            self.deliver(call, args, ts)

    def _finish_backend(self, status: str, ts: int) -> None:
        if self.dropped > self._reported_dropped:
            self.deliver("log_metrics", ({DROPPED_KEY: float(self.dropped)}, self._last_step), ts)
        delivered = self.deliver("finish", (status,), ts)
        self.status_handled = True
        if delivered:
            update_run_record(self.run_dir, self.name, status=status)

    # -- delivery: backend call with our timeout, else the spool ---------------------------------
    def deliver(self, call: str, args: tuple, ts: int) -> bool:
        """Send one record to the backend; spool it when that fails. True when the backend took it."""
        if call == "log_metrics":
            self._last_step = max(self._last_step, int(args[1]))
        elif call == "log_metric_records":
            self._last_step = max(self._last_step, int(args[0][-1][1]))
        abandoned = self.pending.take_off((call, args, ts))  # from here finish() can hand it to the spool
        if abandoned is not None:
            self.spill(call, args, ts, abandoned)
            return False
        try:
            args, error = self._send(call, args, ts)
        finally:
            already = self.pending.land()
        if error is None:
            self.delivered += 1
            reported = _dropped_in(call, args)
            if reported is not None:
                self._reported_dropped = reported
            self.health.up()
            if call in ARTIFACT_CALLS:
                self.artifact_health.up()
            return True
        if not already:
            self.spill(call, args, ts, error,
                       artifacts=call in ARTIFACT_CALLS and self.health.healthy and not self.artifact_health.healthy)
        return False

    def _send(self, call: str, args: tuple, ts: int) -> tuple[tuple, str | None]:
        """One bounded backend call: ``(args sent, None)``, or ``(args, why it failed)``."""
        artifact = call in ARTIFACT_CALLS
        lane = self.artifact_calls if artifact and self.artifact_calls is not None else self.calls
        if artifact and not self.artifact_health.may_call(lane.busy):
            return args, self.artifact_health.reason or "artifact store unavailable"
        inner = self._backend()
        if inner is None:
            return args, self.health.reason or "backend unavailable"
        apart = artifact and bool(getattr(inner, "artifacts_apart", False))
        if apart and self.artifact_calls is None:
            self.artifact_calls = CallThread(f"gradloc-track-{self.name}-artifacts")
        if self.dropped > self._reported_dropped:
            args = _with_dropped(call, args, float(self.dropped))
        try:
            bounded_call(lambda: send(inner, call, args, ts), self.call_timeout_s,
                         thread=self.artifact_calls if apart else self.calls,
                         retries=self.retries, backoff_s=self.retry_backoff_s, what="tracker.call_timeout_s")
        except Exception as exc:  # a refusal, or a ``CallTimeout`` (its call thread is stuck in it)
            if apart:  # the artifact store alone; the tracking store is tried by the next record
                self.artifact_health.down(exc)
                self.spill.artifact_location = getattr(inner, "artifact_location", None)
            else:  # (W&B's media go with its metrics: one service, down together)
                self._down(exc)
            return args, repr(exc)
        return args, None

    def _backend(self) -> Tracker | None:
        """The backend when it may be called now; ``None`` while it is down (between probes)."""
        if not self.health.may_call(self.calls.busy):
            return None
        if self.backend.inner is not None:
            return self.backend.inner
        try:
            inner = self.backend.open()
        except Exception as exc:
            self._down(exc)
            return None
        self.health.up()
        self.batch_values = int(inner.max_metrics_per_request or MAX_METRICS_PER_REQUEST)
        return inner

    def _down(self, exc: BaseException) -> None:
        self.health.down(exc)
        self.spill.warn_down(repr(exc))


def _with_dropped(call: str, args: tuple, dropped: float) -> tuple:
    """``args`` with the ``tracker/dropped`` count added (to the last step of a batch)."""
    if call == "log_metrics":
        return {**args[0], DROPPED_KEY: dropped}, args[1]
    if call == "log_metric_records":
        *head, (metrics, step, ts) = args[0]
        return ([*head, ({**metrics, DROPPED_KEY: dropped}, step, ts)],)
    return args


def _dropped_in(call: str, args: tuple) -> int | None:
    """The ``tracker/dropped`` count a delivered record carried, if any."""
    if call == "log_metrics" and DROPPED_KEY in args[0]:
        return int(args[0][DROPPED_KEY])
    if call == "log_metric_records" and DROPPED_KEY in args[0][-1][0]:
        return int(args[0][-1][0][DROPPED_KEY])
    return None

