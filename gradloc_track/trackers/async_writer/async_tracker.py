"""``AsyncTracker``: the training thread's side of the background writer (see the package doc).

Every ``log_*`` call only enqueues, waiting at most ``put_timeout_s``; a full queue (a backend
too slow) or a call after ``finish()`` (e.g. a step logged after SIGTERM finished the run) sends
the record to the spool instead. Nothing here raises into the training loop. A step of metrics
does not wake the writer thread (it writes once per ``flush_interval_s``): only a full request's
worth of values, any other record, ``flush()`` and ``finish()`` do.

If the writer thread is ever gone (whatever killed it), ``log``/``flush``/``finish`` never wait
for it: records go straight to the spool, with the final status. The run directory is held for
this run (``run_lock``) from construction to ``finish()``.

A process that exits without ``finish()`` (an uncaught exception, a script that forgot it) would
take the metrics still waiting for the interval with its daemon writer thread: at interpreter exit
every unfinished tracker flushes (within ``EXIT_FLUSH_S``); what is left then goes to the spool.
The run's status is left alone (``replay`` ends a run we opened and nobody finished as KILLED).
"""
from __future__ import annotations

import atexit
import functools
import queue
import threading
import time
import warnings
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

from .. import run_lock
from ..interface import Tracker, final_status
from ..bounded import clamp_wait
from ..incomplete import say, writes_of
from ..run_record import update_run_record
from ..spool import Spool
from .closing import closing_lines
from .handover import hand_over
from .jobs import hurry
from .opener import BackendSource, OpenGate
from .pending import FLUSH, STOP, PendingRecords, now_ms
from .settings import WriterSettings
from .spill import Spill
from .writer import MAX_PENDING_STEPS, WriterLoop

if TYPE_CHECKING:
    from ...config import TrackerConfig

#: how long the exit hook waits for a tracker nobody finished (SIGTERM's bound: within a scheduler's grace)
EXIT_FLUSH_S = 20.0
#: how long ``finish()`` waits for the backend before it says it is waiting, and for how long at most
SAY_WAIT_S = 5.0


class AsyncTracker(Tracker):
    """Wraps a backend ``factory`` (built on the writer thread) with a queue, timeouts and a spool.

    ``spec`` (optional) is what ``replay`` needs to reopen the backend run; it is recorded in
    ``<run_dir>/tracker/<name>.json`` together with the backend's run id once it exists.
    ``gate`` (optional) is cancelled when ``finish`` is done before the backend was ever opened: a
    factory that checks it does not create (or ends) a run nobody will finish (``replay`` creates it).
    ``owner``: the run this writer belongs to (trackers of one run share the run directory's lock);
    ``on_open(backend)`` is called once the backend run exists (e.g. to say where it is).
    ``settings``: the queue size and waits (``WriterSettings``; ``from_config`` reads a ``TrackerConfig``).
    Timeouts past ``threading.TIMEOUT_MAX`` are clamped to it.
    """

    #: submitted jobs (artifact rendering) run on the writer thread, in queue order
    runs_jobs_off_thread = True

    def __init__(self, factory: Callable[[], Tracker], name: str, run_dir: str | Path,
                 settings: WriterSettings | None = None, spec: Mapping[str, Any] | None = None,
                 gate: OpenGate | None = None, owner: run_lock.RunOwner | None = None,
                 on_open: Callable[[Tracker], None] | None = None) -> None:
        self.name = name
        self.run_dir = Path(run_dir)
        self.settings = settings = settings if settings is not None else WriterSettings()
        self._owner = owner or run_lock.RunOwner()
        run_lock.acquire(self.run_dir, self._owner)  # RunDirInUse: before anything is written here
        self.spool = Spool(self.run_dir / "spool" / f"{name}.jsonl", name)
        self.finish_timeout_s = settings.finish_timeout_s
        self._q: queue.Queue = queue.Queue(maxsize=settings.queue_size)
        self._finished = False
        self._gone: str | None = None  # why the writer thread ended early, if it did
        self._late_reason = ""  # why finish() took over the jobs it renders late
        self._pending = PendingRecords()
        self._spill = Spill(self.spool, name, self.run_dir)
        self._writer = WriterLoop(BackendSource(factory, name, self.run_dir, gate, on_open), self._q, self._pending,
                                  self._spill, settings)
        # a step of metrics only counts here; the writer is woken when its batch would be full
        self._unsent_values = self._unsent_records = 0
        self._first = True  # the first step wakes the writer at once: it opens the run
        self._wake_records = max(1, min(MAX_PENDING_STEPS, settings.queue_size // 2))
        if spec is not None:
            update_run_record(self.run_dir, name, spec=dict(spec), status=None)
        self._thread = threading.Thread(target=self._run_writer, name=f"gradloc-track-{name}", daemon=True)
        self._thread.start()
        # registered per tracker, so it runs before the exit hooks registered earlier (MLflow's
        # ``start_run`` ends its run at exit: our metrics go in first)
        self._exit_hook = functools.partial(_at_exit, weakref.ref(self))
        atexit.register(self._exit_hook)

    @classmethod
    def from_config(cls, cfg: "TrackerConfig", name: str, factory: Callable[[], Tracker], run_dir: str | Path,
                    spec: Mapping[str, Any] | None = None, gate: OpenGate | None = None,
                    owner: run_lock.RunOwner | None = None,
                    on_open: Callable[[Tracker], None] | None = None) -> "AsyncTracker":
        """The background writer with the bounds a ``TrackerConfig`` sets (runs we open and runs we join)."""
        return cls(factory, name, run_dir, WriterSettings.from_config(cfg), spec, gate, owner, on_open)

    @property
    def dropped(self) -> int:
        """Records lost for good: neither the backend nor the spool could take them."""
        return self.spool.dropped

    @property
    def healthy(self) -> bool:
        return self._writer.health.healthy and self._gone is None

    # -- the writer thread -----------------------------------------------------------------------
    def _run_writer(self) -> None:
        try:
            self._writer.run()
        except BaseException as exc:  # noqa: BLE001 - whatever ended it, nothing queued is lost
            self._gone = f"the {self.name} writer thread is gone ({exc!r})"
            self._spill.warn_once("gone", f"gradloc-track: {self._gone}; every record goes to {self.spool.path} "
                                  f"from now on (`gradloc-track replay {self.run_dir}`)")
            hand_over(self._q, self._pending, self._spill, self._gone)
        finally:
            with self._q.all_tasks_done:  # wake a flush() waiting on this thread
                self._q.all_tasks_done.notify_all()

    # -- producer side (training thread): never blocks longer than put_timeout_s, never raises ----
    def _put(self, call: str, *args: Any) -> None:
        ts = now_ms()
        if self._finished or self._gone is not None:  # e.g. a step logged after a SIGTERM finished the run
            self._spill(call, args, ts, self._gone or "logged after finish()")
            return
        try:
            self._q.put((call, args, ts), timeout=self.settings.put_timeout_s)
        except queue.Full:  # never block training: keep the record in the spool instead
            self._spill(call, args, ts, "queue full (backend too slow)")
            return
        if call != "log_metrics":
            self._wake()  # a table, tag or job: written at once (with the metrics before it)
        else:
            self._unsent_values += len(args[0])
            self._unsent_records += 1
            if (self._unsent_values >= self._writer.batch_values or self._unsent_records >= self._wake_records
                    or self._first):
                self._wake()  # a full request's worth (or half the queue, or the first: it opens the run)
                self._first = False
        if self._gone is not None:  # it died just now: nobody will take what was queued
            hand_over(self._q, self._pending, self._spill, self._gone)

    def _wake(self) -> None:
        self._unsent_values = self._unsent_records = 0
        self._writer.wake.set()

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
        if self._finished or self._gone is not None:
            self._spill.run_job(job, self._gone or "logged after finish()", now_ms())
            return
        try:
            self._q.put(("submit", (job,), now_ms()), timeout=self.settings.put_timeout_s)
        except queue.Full:
            self._spill.run_job(job, "queue full (backend too slow)", now_ms())
            return
        self._wake()

    def flush(self, timeout_s: float | None = None) -> None:
        """Wait until everything logged so far is written or spooled (at most ``finish_timeout_s``). The
        caller waits, so a spike's render still queued or running is hurried, as at ``finish()``."""
        if self._finished:
            return
        limit = clamp_wait(self.finish_timeout_s if timeout_s is None else timeout_s, self.finish_timeout_s)
        deadline = time.monotonic() + limit
        with self._writer.gate.waiting():
            self._hurry_jobs()
            if self._gone is None:
                try:  # done once the metrics merged before it are written: the interval is not waited for
                    self._q.put((FLUSH, (), 0), timeout=limit)
                except queue.Full:
                    pass
                self._wake()
            with self._q.all_tasks_done:
                self._q.all_tasks_done.wait_for(lambda: self._q.unfinished_tasks == 0 or self._gone is not None,
                                                max(0.0, deadline - time.monotonic()))

    def finish(self, status: str = "success", timeout_s: float | None = None) -> None:
        """Deliver what is queued and the final ``status``; after ``timeout_s`` spool the rest. Always returns."""
        if self._finished:
            return
        self._finished = True
        atexit.unregister(self._exit_hook)
        status = final_status(status)  # finish("failed") during a Ctrl-C: the run was killed
        from .. import sigterm

        sigterm.forget(self)
        limit = clamp_wait(self.finish_timeout_s if timeout_s is None else timeout_s, self.finish_timeout_s)
        deadline = time.monotonic() + limit
        self._writer.gate.close()
        self._hurry_jobs()
        if self._gone is None:
            self._enqueue_final(status, deadline)
            self._thread.join(max(0.0, min(SAY_WAIT_S, deadline - time.monotonic())))
            if self._thread.is_alive() and deadline - time.monotonic() > 1.0:
                # a finished progress bar and a minute of silence read as a hang (held-out tester, stop 64)
                say([f"gradloc-track: waiting up to {deadline - time.monotonic():.0f} s more for {self.name} to take "
                     "the run's last records (tracker.finish_timeout_s); what it does not take goes to the spool "
                     f"{self.spool.path}"])
                self._thread.join(max(0.0, deadline - time.monotonic()))
        late: list = []  # spike artifact jobs left: rendered off this thread, within what is left of the bound
        if self._gone is not None:
            self._abandon(status, self._gone, late)
        elif self._thread.is_alive():
            self._abandon(status, f"finish() waited {limit:.0f} s", late)
        self._writer.backend.cancel_if_unopened()  # a run still being created must not outlive this run
        if not (late and self._run_late(late, deadline)):
            run_lock.release(self.run_dir, self._owner)
        if self.dropped:
            warnings.warn(f"gradloc-track: {self.dropped} {self.name} record(s) were LOST (the backend and the "
                          f"spool {self.spool.path} both failed: {self.spool.error}); see the tracker/dropped metric",
                          RuntimeWarning, stacklevel=2)
        writer = self._writer
        artifacts_only = None  # the backend took every record but the spike files its artifact store did not
        if not self._spill.others and writer.artifact_health.reason_first is not None:
            artifacts_only = self._spill.artifact_location or ""
        say(closing_lines(self.name, self.run_dir, self.spool.path, writer.delivered, self.spool.count,
                          self.dropped, writer.health.reason_first or self._spill.first_error, artifacts_only)
            + writes_of(self.run_dir).closing_lines())

    def _hurry_jobs(self) -> None:
        """flush() and finish(): the submitted jobs queued, held or running are hurried (``jobs.hurry``): the
        caller's thread waits for them, no training step runs meanwhile to be spared."""
        with self._q.mutex:
            queued = [args[0] for call, args, _ in self._q.queue if call == "submit"]
        held = self._pending.peek_held()
        if held is not None and held[0] == "submit":
            queued.append(held[1][0])
        hurry([self._writer.gate.job, *queued])

    def _enqueue_final(self, status: str, deadline: float) -> None:
        try:
            self._q.put(("finish", (status,), now_ms()), timeout=max(0.0, deadline - time.monotonic()))
            self._q.put((STOP, (), 0), timeout=max(0.0, deadline - time.monotonic()))
        except queue.Full:
            pass
        self._wake()

    def _abandon(self, status: str, why: str, late: list) -> None:
        """finish() ran out of time: spool everything still pending, in flight or queued, and the status
        (jobs go to ``late``: rendering them here would overrun the bound, seconds each)."""
        gone = why == self._gone  # (already said, when it died)
        self._late_reason = reason = why if gone else f"{why} for the {self.name} backend"
        if not hand_over(self._q, self._pending, self._spill, reason, late) and not self._writer.status_handled:
            self._spill("finish", (status,), now_ms(), reason)
        if not gone:
            self._spill.warn_once("abandon", f"gradloc-track: the {self.name} writer did not finish within the "
                                  f"bound ({why}); what was left is in {self.spool.path} "
                                  f"(`gradloc-track replay {self.run_dir}`)")

    def _run_late(self, jobs: list, deadline: float) -> bool:
        """Render the jobs ``finish()`` took over on a thread of their own, their records to the spool,
        waiting for them only until ``deadline``; ``True`` when some still run (that thread then frees the
        run dir when done, and the process waits for it at exit, at most ``EXIT_FLUSH_S``)."""
        state, guard = {"done": False, "handed": False}, threading.Lock()

        def render() -> None:
            try:
                for job, ts in jobs:
                    hurry([job])  # finish() waits for it (one in a hand-over's gap was not hurried yet)
                    self._spill.run_job(job, self._late_reason, ts)
            finally:
                with guard:
                    state["done"] = True
                    release = state["handed"]
                if release:  # finish() returned before this: the run dir is freed here
                    run_lock.release(self.run_dir, self._owner)

        thread = threading.Thread(target=render, name=f"gradloc-track-{self.name}-late", daemon=True)
        thread.start()
        thread.join(max(0.0, deadline - time.monotonic()))
        with guard:
            left = state["handed"] = not state["done"]
        if left:
            _LATE.append(thread)
            self._spill.warn_once("late", f"gradloc-track: {len(jobs)} spike artifact job(s) were still rendering "
                                  f"when finish() reached its bound; their records go to {self.spool.path} as they "
                                  f"finish (`gradloc-track replay {self.run_dir}`)")
        return left

    def _at_exit(self) -> None:
        """The process exits and nobody finished this run: what is pending is written now (the interval
        is not waited for), else spooled; a ``finish()`` after this (another exit hook) spools its status."""
        if self._finished or self._gone is not None:
            return
        self.flush(min(self.finish_timeout_s, EXIT_FLUSH_S))
        if self._q.unfinished_tasks or len(self._pending):
            self._gone = "the process exited before finish()"
            hand_over(self._q, self._pending, self._spill, self._gone)


_LATE: list[threading.Thread] = []  # artifact jobs still rendering after their finish() returned


@atexit.register
def _wait_for_late_jobs() -> None:
    """At exit, the late jobs' records reach the spool unless the process would wait more than ``EXIT_FLUSH_S``
    for them. Registered when this module is first imported (``gradloc_track.trackers`` imports it on first
    use), so it may run before or after the render worker's exit hook: a job the stopped worker would have
    drawn starts it again (``render_worker._Worker``)."""
    deadline = time.monotonic() + EXIT_FLUSH_S
    for thread in _LATE:
        thread.join(max(0.0, deadline - time.monotonic()))


def _at_exit(ref: "weakref.ref[AsyncTracker]") -> None:
    """Runs before the daemon writer thread dies with the interpreter (``atexit`` runs while it still runs)."""
    tracker = ref()
    if tracker is not None:
        tracker._at_exit()
