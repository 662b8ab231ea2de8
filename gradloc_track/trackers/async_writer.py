"""Logging that never blocks, kills or loses training data: a bounded queue, a writer thread,
and OUR timeout on every backend call.

The training thread only enqueues. The writer thread builds the backend (an unreachable server
cannot stall start-up), merges queued metrics per step and delivers each record through a
*call thread*: it waits at most ``call_timeout_s`` for the SDK (whose own retries, left at their
defaults, can take minutes). A call that fails or times out marks the backend **down**: from
then on records go straight to the spool ``<run_dir>/spool/<backend>.jsonl`` (no minutes of
retries stacking up), and every ``probe_interval_s`` the next record probes the backend again
(only once the stuck call has returned: never two SDK calls at once).

``finish(status)`` waits at most ``finish_timeout_s``; whatever is still queued or in flight
then goes to the spool, with the final status, so ``gradloc-track replay <run dir>`` can
complete the original run. If the spool itself cannot be written (disk full), the records are
counted in ``dropped``, reported once in a warning and logged as ``tracker/dropped`` when the
backend takes data again. Nothing here raises into the training loop.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
import warnings
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any, Callable, Mapping

from .base import Tracker
from .run_record import update_run_record
from .spool import Spool

log = logging.getLogger(__name__)
_STOP = object()
DROPPED_KEY = "tracker/dropped"


class CallTimeout(TimeoutError):
    pass


class _CallThread:
    """One daemon thread that runs backend calls, so the writer can stop waiting on one.

    A call that outlives its timeout keeps running here (Python cannot cancel it); ``busy`` stays
    true until it returns and no other call is started meanwhile. Daemon: a stuck SDK call never
    holds the interpreter open at exit.
    """

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._current: Future | None = None
        threading.Thread(target=self._run, name=name, daemon=True).start()

    @property
    def busy(self) -> bool:
        return self._current is not None and not self._current.done()

    def submit(self, fn: Callable[[], Any]) -> Future:
        fut: Future = Future()
        self._current = fut
        self._jobs.put((fn, fut))
        return fut

    def _run(self) -> None:
        while True:
            fn, fut = self._jobs.get()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting writer
                fut.set_exception(exc)


class _Sink(Tracker):
    """What a submitted job logs through: each call goes to ``deliver(call, args, ts)`` in order."""

    def __init__(self, deliver: Callable[[str, tuple, int], Any], ts: int) -> None:
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


def _now_ms() -> int:
    return int(time.time() * 1000)


class AsyncTracker(Tracker):
    """Wraps a backend ``factory`` (built on the writer thread) with a queue, timeouts and a spool.

    ``spec`` (optional) is what ``replay`` needs to reopen the backend run; it is recorded in
    ``<run_dir>/tracker/<name>.json`` together with the backend's run id once it exists.
    ``cancel`` (optional) is set when ``finish`` gives up before the backend was ever opened: a
    factory that checks it does not create a run nobody will finish (``replay`` creates it).
    """

    #: submitted jobs (artifact rendering) run on the writer thread, in queue order
    runs_jobs_off_thread = True

    def __init__(self, factory: Callable[[], Tracker], name: str, run_dir: str | Path,
                 queue_size: int = 10000, flush_interval_s: float = 1.0, retries: int = 3,
                 retry_backoff_s: float = 0.5, put_timeout_s: float = 0.05, call_timeout_s: float = 10.0,
                 finish_timeout_s: float = 120.0, probe_interval_s: float = 30.0, open_timeout_s: float = 120.0,
                 spec: Mapping[str, Any] | None = None, cancel: threading.Event | None = None) -> None:
        self.name = name
        self.run_dir = Path(run_dir)
        self.spool = Spool(self.run_dir / "spool" / f"{name}.jsonl", name)
        self.call_timeout_s, self.finish_timeout_s, self.probe_interval_s = call_timeout_s, finish_timeout_s, probe_interval_s
        self.open_timeout_s = open_timeout_s
        self._factory = factory
        self._inner: Tracker | None = None
        self._opening: Future | None = None  # a factory call that timed out but may still succeed
        self._stuck: Future | None = None  # the last call that timed out
        self._healthy = True
        self._next_probe = 0.0
        self._down_reason: str | None = None
        self._q: queue.Queue = queue.Queue(maxsize=queue_size)
        self._flush_interval = flush_interval_s
        self._retries, self._backoff, self._put_timeout = retries, retry_backoff_s, put_timeout_s
        self._lock = threading.Lock()  # guards the hand-over of pending/in-flight records at finish
        self._pending: dict[int, tuple[dict[str, float], int]] = {}  # step -> (merged metrics, ts)
        self._inflight: tuple[str, tuple, int] | None = None
        self._inflight_spooled = False
        # a non-metrics record the writer took off the queue and holds while the metrics queued
        # before it are written (they may hang): finish() spools it in its place if it gives up
        self._held: tuple | None = None
        self._abandoned: str | None = None  # why the writer was given up on (finish timed out)
        self._status_handled = False
        self._last_step = 0
        self._reported_dropped = 0
        self._warned: set[str] = set()
        self._finished = False
        self._cancel = cancel
        self._caller = _CallThread(f"gradloc-track-{name}-call")
        if spec is not None:
            update_run_record(self.run_dir, name, spec=dict(spec), status=None)
        self._thread = threading.Thread(target=self._run, name=f"gradloc-track-{name}", daemon=True)
        self._thread.start()

    @property
    def dropped(self) -> int:
        """Records lost for good: neither the backend nor the spool could take them."""
        return self.spool.dropped

    @property
    def healthy(self) -> bool:
        return self._healthy

    # -- producer side (training thread): never blocks longer than put_timeout_s, never raises ----
    def _put(self, call: str, *args: Any) -> None:
        ts = _now_ms()
        if self._finished:  # e.g. a step logged after a SIGTERM finished the run: keep it
            self._spill(call, args, ts, "logged after finish()")
            return
        try:
            self._q.put((call, args, ts), timeout=self._put_timeout)
        except queue.Full:  # never block training: keep the record in the spool instead
            self._spill(call, args, ts, "queue full (backend too slow)")

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

    def submit(self, job: Callable[[Tracker], None]) -> None:
        """Run ``job(tracker)`` on the writer thread, after everything queued before it."""
        if self._finished:
            self._run_job(job, _Sink(self._spool_only("logged after finish()"), _now_ms()))
            return
        try:
            self._q.put(("submit", (job,), _now_ms()), timeout=self._put_timeout)
        except queue.Full:
            self._run_job(job, _Sink(self._spool_only("queue full (backend too slow)"), _now_ms()))

    def flush(self, timeout_s: float | None = None) -> None:
        """Wait until everything queued so far is written or spooled (at most ``finish_timeout_s``)."""
        if self._finished:
            return
        limit = self.finish_timeout_s if timeout_s is None else timeout_s
        with self._q.all_tasks_done:
            self._q.all_tasks_done.wait_for(lambda: self._q.unfinished_tasks == 0, limit)

    def finish(self, status: str = "success", timeout_s: float | None = None) -> None:
        """Deliver what is queued and the final ``status``; after ``timeout_s`` spool the rest. Always returns."""
        if self._finished:
            return
        self._finished = True
        from . import sigterm

        sigterm.forget(self)
        limit = self.finish_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + limit
        try:
            self._q.put(("finish", (status,), _now_ms()), timeout=max(0.0, deadline - time.monotonic()))
            self._q.put((_STOP, (), 0), timeout=max(0.0, deadline - time.monotonic()))
        except queue.Full:
            pass
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():
            self._abandon(status, f"finish() waited {limit:.0f} s")
        if self.dropped:
            warnings.warn(f"gradloc-track: {self.dropped} {self.name} record(s) were LOST (the backend and the "
                          f"spool {self.spool.path} both failed: {self.spool.error}); see the tracker/dropped metric",
                          RuntimeWarning, stacklevel=2)

    # -- consumer side (writer thread) -----------------------------------------------------
    def _run(self) -> None:
        last = time.monotonic()
        while True:
            try:
                call, args, ts = self._q.get(timeout=self._flush_interval)
            except queue.Empty:
                if self._abandoned is not None:
                    return  # finish() took over: everything left is in the spool
                self._guard(self._write_metrics)
                last = time.monotonic()
                continue
            try:
                if call is _STOP:
                    self._guard(self._write_metrics)
                    return
                if call == "log_metrics":
                    self._guard(self._merge, args, ts)
                    if time.monotonic() - last >= self._flush_interval or len(self._pending) >= 256:
                        self._guard(self._write_metrics)
                        last = time.monotonic()
                else:  # keep order: metrics queued before this record go first
                    with self._lock:
                        self._held = (call, args, ts)
                    self._guard(self._write_metrics)
                    with self._lock:
                        held, self._held = self._held, None
                    if held is not None:  # None: finish() gave up meanwhile and spooled it in order
                        self._guard(self._handle, call, args, ts)
                if self._q.qsize() == 0:  # flush() must not return with metrics held back
                    self._guard(self._write_metrics)
            finally:
                self._q.task_done()

    def _guard(self, fn: Callable, *args: Any) -> None:
        """The writer thread never dies: an unexpected error is reported once and skipped."""
        try:
            fn(*args)
        except Exception as exc:  # noqa: BLE001
            self._warn_once("writer", f"gradloc-track: the {self.name} writer hit an unexpected error ({exc!r}); "
                            "it keeps running")

    def _merge(self, args: tuple, ts: int) -> None:
        metrics, step = args
        with self._lock:
            if self._abandoned is None:
                merged, first_ts = self._pending.get(step, ({}, ts))
                merged.update(metrics)
                self._pending[step] = (merged, first_ts)
                return
        self._spill("log_metrics", args, ts, self._abandoned)

    def _write_metrics(self) -> None:
        # one step at a time: what is not yet in flight stays visible to finish()'s hand-over
        while True:
            with self._lock:
                if not self._pending:
                    return
                step = min(self._pending)
                metrics, ts = self._pending.pop(step)
            self._deliver("log_metrics", (metrics, step), ts)

    def _handle(self, call: str, args: tuple, ts: int) -> None:
        if call == "submit":
            self._run_job(args[0], _Sink(self._deliver, ts))
        elif call == "finish":
            self._finish_backend(args[0], ts)
        else:
            self._deliver(call, args, ts)

    def _run_job(self, job: Callable[[Tracker], None], sink: Tracker) -> None:
        try:
            job(sink)
        except Exception as exc:  # rendering an artifact failed: report, never crash the writer
            warnings.warn(f"gradloc-track: a background {self.name} job failed: {exc!r}", RuntimeWarning)

    def _finish_backend(self, status: str, ts: int) -> None:
        if self.dropped > self._reported_dropped:
            self._deliver("log_metrics", ({DROPPED_KEY: float(self.dropped)}, self._last_step), ts)
        delivered = self._deliver("finish", (status,), ts)
        self._status_handled = True
        if delivered:
            update_run_record(self.run_dir, self.name, status=status)

    # -- delivery: backend call with our timeout, else the spool ---------------------------
    def _deliver(self, call: str, args: tuple, ts: int) -> bool:
        """Send one record to the backend; spool it when that fails. True when the backend took it."""
        if call == "log_metrics":
            self._last_step = max(self._last_step, int(args[1]))
        with self._lock:  # from here the record is "in flight": finish() can hand it to the spool
            abandoned = self._abandoned
            if abandoned is None:
                self._inflight, self._inflight_spooled = (call, args, ts), False
        if abandoned is not None:
            self._spill(call, args, ts, abandoned)
            return False
        ok, error = False, "backend unavailable"
        try:
            inner = self._backend()
            if inner is None:
                error = self._down_reason or error
            else:
                if call == "log_metrics" and self.dropped > self._reported_dropped:
                    args = ({**args[0], DROPPED_KEY: float(self.dropped)}, args[1])
                try:
                    self._bounded(lambda: self._invoke(inner, call, args, ts))
                    ok = True
                except Exception as exc:
                    self._mark_down(exc)
                    error = repr(exc)
        finally:
            with self._lock:
                already = self._inflight_spooled
                self._inflight = None
        if ok:
            if call == "log_metrics" and DROPPED_KEY in args[0]:
                self._reported_dropped = int(args[0][DROPPED_KEY])
            self._mark_up()
            return True
        if not already:
            self._spill(call, args, ts, error)
        return False

    def _spool_only(self, reason: str) -> Callable[[str, tuple, int], bool]:
        def deliver(call: str, args: tuple, ts: int) -> bool:
            self._spill(call, args, ts, reason)
            return False
        return deliver

    @staticmethod
    def _invoke(inner: Tracker, call: str, args: tuple, ts: int) -> Any:
        if call == "log_metrics" and getattr(inner, "accepts_timestamp", False):
            # the enqueue time travels with the record: a replayed metric is the SAME row (no duplicate)
            return inner.log_metrics(*args, timestamp_ms=ts)
        return getattr(inner, call)(*args)

    def _bounded(self, fn: Callable[[], Any], timeout_s: float | None = None, what: str = "call_timeout_s") -> Any:
        """``fn()`` on the call thread; quick failures retried; at most ``call_timeout_s`` in all."""
        limit = self.call_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + limit
        attempt = 0
        while True:
            fut = self._caller.submit(fn)
            try:
                return fut.result(timeout=max(0.0, deadline - time.monotonic()))
            except FutureTimeout:
                self._stuck = fut
                raise CallTimeout(f"no answer within {limit:g} s (tracker.{what})") from None
            except Exception:
                wait = self._backoff * (2 ** attempt)
                attempt += 1
                if attempt > self._retries or time.monotonic() + wait >= deadline:
                    raise
                time.sleep(wait)

    def _backend(self) -> Tracker | None:
        """The backend when it may be called now; ``None`` while it is down (between probes)."""
        if not self._healthy:
            stuck = self._stuck
            if stuck is not None and stuck.done() and stuck.exception() is None:
                self._stuck, self._next_probe = None, 0.0  # the slow call got through after all: try now
            if time.monotonic() < self._next_probe or self._caller.busy:
                return None
        if self._inner is not None:
            return self._inner
        if self._opening is not None:  # an earlier attempt timed out: it may have finished since
            fut, self._opening = self._opening, None
            if fut.done() and fut.exception() is None:
                return self._opened(fut.result())
        try:
            inner = self._bounded(self._factory, self.open_timeout_s, "open_timeout_s")
        except CallTimeout as exc:
            self._opening = self._stuck  # keep it: a late success is still our run
            self._mark_down(exc)
            return None
        except Exception as exc:
            self._mark_down(exc)
            return None
        return self._opened(inner)

    def _opened(self, inner: Tracker) -> Tracker:
        self._inner = inner
        ref = getattr(inner, "run_ref", None)
        if callable(ref):
            update_run_record(self.run_dir, self.name, run=ref())
        self._mark_up()
        return inner

    def _mark_down(self, exc: BaseException) -> None:
        if self._healthy:
            log.warning("%s tracker down (%r); spooling to %s, probing every %g s", self.name, exc,
                        self.spool.path, self.probe_interval_s)
        self._healthy = False
        self._down_reason = f"backend down since an earlier call failed: {exc!r}"
        self._next_probe = time.monotonic() + self.probe_interval_s
        self._warn_once("down", f"gradloc-track: the {self.name} tracker failed ({exc!r}); records are kept in "
                        f"{self.spool.path} (replay with `gradloc-track replay {self.run_dir}`)")

    def _mark_up(self) -> None:
        if not self._healthy:
            log.warning("%s tracker is back", self.name)
        self._healthy, self._down_reason = True, None

    # -- spool -----------------------------------------------------------------------------
    def _spill(self, call: str, args: tuple, ts: int, error: str) -> None:
        self.spool.write(call, args, error, ts=ts)
        self._warn_once("down", f"gradloc-track: the {self.name} tracker failed ({error}); records are kept in "
                        f"{self.spool.path} (replay with `gradloc-track replay {self.run_dir}`)")

    def _abandon(self, status: str, why: str) -> None:
        """finish() ran out of time: spool everything still pending, in flight or queued."""
        reason = f"{why} for the {self.name} backend"
        if self._inner is None and self._cancel is not None:
            self._cancel.set()  # a still-running open must not create a run nobody finishes
        with self._lock:
            self._abandoned = reason
            pending, self._pending = self._pending, {}
            inflight = self._inflight
            self._inflight_spooled = inflight is not None
            held, self._held = self._held, None
        if inflight is not None:
            call, args, ts = inflight
            self._spill(call, args, ts, f"{reason} (in flight: the backend may also have it)")
        for step in sorted(pending):
            self._spill("log_metrics", (pending[step][0], step), pending[step][1], reason)
        saw_finish = False
        if held is not None and held[0] != "submit":  # queued after those metrics, before the rest
            saw_finish = held[0] == "finish"
            self._spill(*held, reason)
        elif held is not None:
            self._run_job(held[1][0], _Sink(self._spool_only(reason), held[2]))
        while True:
            try:
                call, args, ts = self._q.get_nowait()
            except queue.Empty:
                break
            try:
                if call == "submit":
                    self._run_job(args[0], _Sink(self._spool_only(reason), ts))
                elif call == "finish":
                    saw_finish = True
                    self._spill(call, args, ts, reason)
                elif call is not _STOP:
                    self._spill(call, args, ts, reason)
            finally:
                self._q.task_done()
        if not saw_finish and not self._status_handled and not (inflight and inflight[0] == "finish"):
            self._spill("finish", (status,), _now_ms(), reason)
        self._warn_once("abandon", f"gradloc-track: the {self.name} writer did not finish within the bound "
                        f"({why}); what was left is in {self.spool.path} (`gradloc-track replay {self.run_dir}`)")

    def _warn_once(self, what: str, message: str) -> None:
        if what not in self._warned:  # once per kind; the spool file holds every record
            self._warned.add(what)
            warnings.warn(message, RuntimeWarning, stacklevel=3)
