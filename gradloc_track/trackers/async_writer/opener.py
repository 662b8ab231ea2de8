"""The backend run, opened lazily on the writer's call thread within ``open_timeout_s``.

An unreachable server cannot stall start-up: the factory runs on first use, bounded like every
call. An open that timed out may still succeed later: that run is ours, adopted on the next try
rather than a second one created. ``cancel`` (optional) is set when ``finish()`` gives up before
the backend was ever opened: a factory that checks it does not create a run nobody will finish
(``replay`` creates it instead). Once open, the run's reference goes into the run record.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Callable

from ..base import Tracker
from ..bounded import CallThread, CallTimeout, bounded_call
from ..run_record import update_run_record


class LazyBackend:
    def __init__(self, factory: Callable[[], Tracker], name: str, run_dir: Path, open_timeout_s: float,
                 calls: CallThread, retries: int, backoff_s: float, cancel: threading.Event | None) -> None:
        self._factory, self.name, self.run_dir = factory, name, run_dir
        self.open_timeout_s, self._calls, self._retries, self._backoff = open_timeout_s, calls, retries, backoff_s
        self._cancel = cancel
        self.inner: Tracker | None = None
        self._opening: Future | None = None  # a factory call that timed out but may still succeed

    def open(self) -> Tracker:
        """The backend, opening it if needed; raises (``CallTimeout`` or the factory's error) when it cannot."""
        if self.inner is not None:
            return self.inner
        if self._opening is not None:  # an earlier attempt timed out: it may have finished since
            fut, self._opening = self._opening, None
            if fut.done() and fut.exception() is None:
                return self._opened(fut.result())
        try:
            inner = bounded_call(self._factory, self.open_timeout_s, thread=self._calls, retries=self._retries,
                                 backoff_s=self._backoff, what="tracker.open_timeout_s")
        except CallTimeout as exc:
            self._opening = exc.future  # keep it: a late success is still our run
            raise
        return self._opened(inner)

    def _opened(self, inner: Tracker) -> Tracker:
        self.inner = inner
        ref = getattr(inner, "run_ref", None)
        if callable(ref):
            update_run_record(self.run_dir, self.name, run=ref())
        return inner

    def cancel_if_unopened(self) -> None:
        """``finish()`` gave up: a still-running open must not create a run nobody finishes."""
        if self.inner is None and self._cancel is not None:
            self._cancel.set()
