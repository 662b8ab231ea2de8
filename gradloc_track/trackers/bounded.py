"""Run a call on a thread and stop waiting for it at a deadline (quick failures retried).

An SDK call (MLflow, W&B) retries on its own for minutes, and Python cannot cancel a thread. So
the call runs on a daemon thread and the caller waits at most ``timeout_s``: a call past its
bound keeps running there (``CallTimeout.future`` still receives its late result) while the
caller moves on. A call that fails quickly is tried again after ``backoff_s``, ``2 * backoff_s``,
..., at most ``retries`` times, every try inside the one bound.

A ``BaseException`` that is not an ``Exception`` (``SystemExit``, ``KeyboardInterrupt``,
``GeneratorExit``, an SDK's own) raised by the call is caught on the call's thread and raised to the
caller as ``CallAborted``: an SDK that calls ``sys.exit()`` off the main thread is a backend failing,
never a reason for the caller's thread (the writer) to die. A real Ctrl-C reaches the MAIN thread
only, never these threads.

Every wait is clamped to ``threading.TIMEOUT_MAX`` (~9.2e9 s, the longest wait a lock can make):
a longer one would raise ``OverflowError``.

The one place this is written. Users: the background writer (one long-lived ``CallThread`` per
backend, so two SDK calls never overlap), ``gradloc-track report`` (waiting on an MLflow server)
and the SIGTERM handler (a ``finish()`` that must not hang a dying process).
"""
from __future__ import annotations

import math
import queue
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable

#: the longest wait the platform's locks take (longer raises OverflowError)
MAX_WAIT_S = threading.TIMEOUT_MAX


def clamp_wait(seconds: float, default: float = MAX_WAIT_S) -> float:
    """``seconds`` as a wait a lock can make: in ``[0, MAX_WAIT_S]``; NaN gives ``default``."""
    if seconds is None or math.isnan(seconds):
        seconds = default
    return min(max(float(seconds), 0.0), MAX_WAIT_S)


class CallTimeout(TimeoutError):
    """No answer within the bound. ``future`` is the call itself, which may still finish later."""

    def __init__(self, message: str, future: Future) -> None:
        super().__init__(message)
        self.future = future


class CallAborted(Exception):
    """The call raised a ``BaseException`` that is not an ``Exception`` (``cause``): not retried."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"the call raised {type(cause).__name__}({cause})")
        self.cause = cause


def _run_into(fn: Callable[[], Any], fut: Future) -> None:
    try:
        fut.set_result(fn())
    except Exception as exc:  # noqa: BLE001 - handed to the waiting caller
        fut.set_exception(exc)
    except BaseException as exc:  # noqa: BLE001 - SystemExit & co. from an SDK: the call failed, not us
        fut.set_exception(CallAborted(exc))


def start_thread(fn: Callable[[], Any], name: str = "gradloc-track-call") -> Future:
    """``fn()`` on a new daemon thread; its result or exception lands on the returned future.

    Daemon: a call that never returns never holds the interpreter open at exit.
    """
    fut: Future = Future()
    fut.set_running_or_notify_cancel()
    threading.Thread(target=_run_into, args=(fn, fut), name=name, daemon=True).start()
    return fut


class CallThread:
    """One daemon thread that runs calls in order (one backend's SDK calls never overlap).

    A call that outlives its bound keeps running here; ``busy`` stays true until it returns.
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
            if fut.set_running_or_notify_cancel():
                _run_into(fn, fut)


def bounded_call(fn: Callable[[], Any], timeout_s: float, *, thread: CallThread | None = None,
                 name: str = "gradloc-track-call", retries: int = 0, backoff_s: float = 0.0,
                 what: str = "the call") -> Any:
    """``fn()`` on ``thread`` (else a new daemon thread named ``name``); at most ``timeout_s`` in all.

    Returns what ``fn`` returns. An exception ``fn`` raises is retried while tries and time are
    left, then raised here. No answer in time raises ``CallTimeout("no answer within <t> s (<what>)")``.
    """
    timeout_s = clamp_wait(timeout_s)
    deadline = time.monotonic() + timeout_s
    attempt = 0
    while True:
        fut = thread.submit(fn) if thread is not None else start_thread(fn, name)
        try:
            return fut.result(timeout=max(0.0, deadline - time.monotonic()))
        except FutureTimeout:
            if not fut.done():  # (an SDK's own TimeoutError leaves the future done: a quick failure)
                raise CallTimeout(f"no answer within {timeout_s:g} s ({what})", fut) from None
        except Exception:
            pass
        if fut.exception() is None:  # answered just as the wait ended
            return fut.result()
        if isinstance(fut.exception(), CallAborted):
            return fut.result()  # raises it: SystemExit & co. are not a quick failure to retry
        wait = backoff_s * (2 ** attempt)
        attempt += 1
        if attempt > retries or time.monotonic() + wait >= deadline:
            return fut.result()  # raises fn's exception
        time.sleep(wait)
