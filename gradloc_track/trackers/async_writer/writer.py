"""The writer thread: records off the queue in order, metrics merged per step, each record
delivered through the call thread within ``call_timeout_s``, or spooled.

Order is kept: a non-metrics record waits (held) until the metrics queued before it are written.
Metrics are written at least every ``flush_interval_s``, when 256 steps are pending, and whenever
the queue runs empty (so ``flush()`` never returns with metrics held back).

Batches across steps: a backend with ``log_metric_records`` (MLflow's ``log_batch`` takes many
metrics, each with its step) gets every pending step in ONE request, in step order, up to its
``max_metrics_per_request``. While a slow request is in flight the next steps pile up in pending
and go together in the next one, so a server slower than training still receives every step
while training runs. Backends without it (W&B: its ``log`` is local) get one call per step.

Nothing a backend raises kills this thread: ``BaseException``s come back from the call thread
as ``CallAborted`` (a failed call: down, spooled), and the loop guards the rest.
"""
from __future__ import annotations

import queue
import time
from pathlib import Path
from typing import Any, Callable

from ..interface import Tracker
from ..bounded import CallThread, bounded_call, clamp_wait
from ..naming import DROPPED_KEY
from ..run_record import update_run_record
from .health import BackendHealth
from .jobs import JobSink, run_job
from .opener import LazyBackend, OpenGate
from .pending import STOP, PendingRecords
from .spill import Spill

MAX_PENDING_STEPS = 256  # merged steps held before they are written regardless of the interval
MAX_METRICS_PER_REQUEST = 1000  # a batch's size when the backend names none


class WriterLoop:
    def __init__(self, factory: Callable[[], Tracker], name: str, run_dir: Path, q: queue.Queue,
                 pending: PendingRecords, spill: Spill, *, flush_interval_s: float, retries: int,
                 retry_backoff_s: float, call_timeout_s: float, probe_interval_s: float, open_timeout_s: float,
                 gate: OpenGate | None, on_open: Callable[[Tracker], None] | None = None) -> None:
        self.name, self.run_dir, self.q, self.pending, self.spill = name, run_dir, q, pending, spill
        self.flush_interval_s, self.call_timeout_s = clamp_wait(flush_interval_s), clamp_wait(call_timeout_s)
        self.retries, self.retry_backoff_s = retries, retry_backoff_s
        self.calls = CallThread(f"gradloc-track-{name}-call")
        self.health = BackendHealth(name, probe_interval_s, spill.spool.path)
        self.backend = LazyBackend(factory, name, run_dir, open_timeout_s, self.calls, retries, retry_backoff_s,
                                   gate, on_open)
        self.status_handled = False  # the final status reached the backend or the spool
        self._last_step = 0
        self._reported_dropped = 0

    @property
    def dropped(self) -> int:
        return self.spill.spool.dropped

    # -- the loop --------------------------------------------------------------------------------
    def run(self) -> None:
        last = time.monotonic()
        while True:
            try:
                call, args, ts = self.q.get(timeout=self.flush_interval_s)
            except queue.Empty:
                if self.pending.abandoned is not None:
                    return  # finish() took over: everything left is in the spool
                self._guard(self._write_metrics)
                last = time.monotonic()
                continue
            try:
                if call is STOP:
                    self._guard(self._write_metrics)
                    return
                last = self._take(call, args, ts, last)
            finally:
                self.q.task_done()

    def _take(self, call: str, args: tuple, ts: int, last: float) -> float:
        """Handle one queued record; returns when metrics were last written."""
        if call == "log_metrics":
            self._guard(self._merge, args, ts)
            if time.monotonic() - last >= self.flush_interval_s or len(self.pending) >= MAX_PENDING_STEPS:
                self._guard(self._write_metrics)
                last = time.monotonic()
        else:  # keep order: metrics queued before this record go first
            self.pending.hold((call, args, ts))
            self._guard(self._write_metrics)
            if self.pending.unhold() is not None:  # None: finish() gave up meanwhile and spooled it in order
                self._guard(self._handle, call, args, ts)
        if self.q.qsize() == 0:  # flush() must not return with metrics held back
            self._guard(self._write_metrics)
        return last

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

    def _write_metrics(self) -> None:
        # what is not yet in flight stays visible to finish()'s hand-over
        while len(self.pending):
            inner = self.backend.inner  # (None until opened: the first step opens it)
            if inner is not None and callable(getattr(inner, "log_metric_records", None)):
                limit = getattr(inner, "max_metrics_per_request", MAX_METRICS_PER_REQUEST)
                record = self.pending.pop_batch(limit - 1)  # (room for tracker/dropped: still one request)
            else:
                record = self.pending.pop_first()
            if record is not None:
                self.deliver(*record)

    def _handle(self, call: str, args: tuple, ts: int) -> None:
        if call == "submit":
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
            reported = _dropped_in(call, args)
            if reported is not None:
                self._reported_dropped = reported
            self.health.up()
            return True
        if not already:
            self.spill(call, args, ts, error)
        return False

    def _send(self, call: str, args: tuple, ts: int) -> tuple[tuple, str | None]:
        """One bounded backend call: ``(args sent, None)``, or ``(args, why it failed)``."""
        inner = self._backend()
        if inner is None:
            return args, self.health.reason or "backend unavailable"
        if self.dropped > self._reported_dropped:
            args = _with_dropped(call, args, float(self.dropped))
        try:
            bounded_call(lambda: _invoke(inner, call, args, ts), self.call_timeout_s, thread=self.calls,
                         retries=self.retries, backoff_s=self.retry_backoff_s, what="tracker.call_timeout_s")
        except Exception as exc:
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


def _invoke(inner: Tracker, call: str, args: tuple, ts: int) -> Any:
    if call == "log_metrics" and getattr(inner, "accepts_timestamp", False):
        # the enqueue time travels with the record: a replayed metric is the SAME row (no duplicate)
        return inner.log_metrics(*args, timestamp_ms=ts)
    return getattr(inner, call)(*args)
