"""SIGTERM (what Slurm, Kubernetes and other schedulers send on preemption) ends our runs as KILLED.

While at least one run opened by ``make_tracker`` is active, a handler is installed in the MAIN
thread only (Python delivers signals there; ``signal.signal`` elsewhere raises). On SIGTERM it
finishes every active run with status ``"killed"`` (queued records flushed, the rest spooled,
within ``GRACE_S`` = 20 s, under the usual 30 s before a scheduler's SIGKILL), then chains to the
handler that was installed before: a Python handler is called; the default action is restored
and the signal re-raised, so the process still dies of SIGTERM; an ignored SIGTERM stays ignored
(and the runs are left open, since the process keeps training). When the last run finishes, the
previous handler is restored (unless someone replaced ours meanwhile). Records logged after the
handler ran (a previous handler that lets training go on) go to the spool.
"""
from __future__ import annotations

import logging
import signal
import threading
from typing import Any

from .bounded import bounded_call

log = logging.getLogger(__name__)

#: seconds the handler gives each run's finish(): under the 30 s grace most schedulers allow
#: between SIGTERM and SIGKILL (Kubernetes' default, Slurm's KillWait); what is left is spooled
GRACE_S = 20.0

_active: list[Any] = []
_previous: Any = None
_installed = False
_lock = threading.RLock()


def _handler(signum, frame) -> None:
    prev = _previous
    if prev is signal.SIG_IGN:
        return
    runs = list(_active)
    log.warning("SIGTERM: ending %d tracker run(s) as KILLED", len(runs))
    for tracker in runs:
        _finish_killed(tracker)
    _uninstall()
    if callable(prev):
        prev(signum, frame)
    else:  # SIG_DFL (or None: installed from C): die of SIGTERM as the scheduler expects
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.raise_signal(signal.SIGTERM)


def _finish_killed(tracker: Any) -> None:
    # the handler runs in the main thread between two bytecodes, possibly while the training code
    # holds a queue lock: finish on a helper thread and wait a bounded time for it
    try:
        bounded_call(lambda: tracker.finish("killed", timeout_s=GRACE_S), GRACE_S + 5.0,
                     name="gradloc-track-sigterm", what="finish on SIGTERM")
    except Exception as exc:  # noqa: BLE001 - a dying process must still reach the previous handler
        log.warning("SIGTERM: finishing %r failed: %r", tracker, exc)


def guard(tracker: Any) -> None:
    """Finish ``tracker`` as KILLED on SIGTERM until ``forget(tracker)`` (its ``finish``)."""
    global _previous, _installed
    if threading.current_thread() is not threading.main_thread():
        return  # signal handlers can only be installed from the main thread
    with _lock:
        _active.append(tracker)
        try:
            current = signal.getsignal(signal.SIGTERM)
            if not _installed or current is not _handler:  # first run, or someone installed over ours:
                _previous = current  # chain to whatever is there now
                signal.signal(signal.SIGTERM, _handler)
        except (ValueError, OSError):  # embedded interpreters without signal support
            return
        _installed = True


def forget(tracker: Any) -> None:
    with _lock:
        if tracker in _active:
            _active.remove(tracker)
        if not _active:
            _uninstall_locked()


def _uninstall() -> None:
    with _lock:
        _uninstall_locked()


def _uninstall_locked() -> None:
    global _installed
    if not _installed or threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is _handler:  # someone else's handler since: leave it
        signal.signal(signal.SIGTERM, _previous if _previous is not None else signal.SIG_DFL)
    _installed = False


def active() -> list[Any]:
    return list(_active)
