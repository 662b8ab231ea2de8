"""The backend run, opened lazily on the writer's call thread within ``open_timeout_s``.

An unreachable server cannot stall start-up: the factory runs on first use, bounded like every
call. An open that timed out may still succeed later: that run is ours, adopted on the next try
rather than a second one created.

One run per run directory, even when the server answers late: when ``finish()`` gives up before
the backend was ever opened it cancels the ``OpenGate``. A factory that checks the gate does not
create a run nobody will finish; one whose creation was already on its way claims the gate once the
run exists, and a late run (the claim refused) is ended by the adapter and never recorded:
``replay`` creates the run from the spool instead. The run's reference goes into the run record
on the call thread, as soon as the run exists, so ``replay`` finds it even if the writer was
abandoned meanwhile.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..interface import Tracker
from ..bounded import CallThread, CallTimeout, bounded_call
from ..run_record import update_run_record
from .settings import WriterSettings


class OpenGate:
    """Decides, once, whether a run being created is ours (``claim``) or abandoned (``cancel``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state: str | None = None  # None | "claimed" | "cancelled"

    def is_set(self) -> bool:
        """True once cancelled: a factory checks this before each step of creating the run."""
        return self._state == "cancelled"

    def claim(self) -> bool:
        """The run now exists: ``True`` when it is ours to use, ``False`` when ``finish()`` gave up on it."""
        with self._lock:
            if self._state is None:
                self._state = "claimed"
            return self._state == "claimed"

    def cancel(self) -> bool:
        """``finish()`` gives up: ``True`` when no run was claimed (a late one will be ended)."""
        with self._lock:
            if self._state is None:
                self._state = "cancelled"
            return self._state == "cancelled"


@dataclass
class BackendSource:
    """What makes one backend run: ``factory()`` builds it (on the call thread); its records are
    kept under ``run_dir`` as ``name``; ``gate`` (see ``OpenGate``) and ``on_open(backend)``, once
    the run exists, are optional."""

    factory: Callable[[], Tracker]
    name: str
    run_dir: Path
    gate: OpenGate | None = None
    on_open: Callable[[Tracker], None] | None = None


class LazyBackend:
    def __init__(self, source: BackendSource, calls: CallThread, settings: WriterSettings) -> None:
        self._factory, self.name, self.run_dir = source.factory, source.name, source.run_dir
        self.open_timeout_s, self._calls = settings.open_timeout_s, calls
        self._retries, self._backoff = settings.retries, settings.retry_backoff_s
        self._gate, self._on_open = source.gate, source.on_open
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
            inner = bounded_call(self._build, self.open_timeout_s, thread=self._calls, retries=self._retries,
                                 backoff_s=self._backoff, what="tracker.open_timeout_s")
        except CallTimeout as exc:
            self._opening = exc.future  # keep it: a late success is still our run
            raise
        return self._opened(inner)

    def _build(self) -> Tracker:
        """On the call thread: the factory, then the run's reference in the run record at once."""
        inner = self._factory()
        ref = inner.run_ref()
        if ref is not None:
            update_run_record(self.run_dir, self.name, run=ref)
        return inner

    def _opened(self, inner: Tracker) -> Tracker:
        self.inner = inner
        if self._on_open is not None:
            try:
                self._on_open(inner)
            except Exception:  # noqa: BLE001 - a message about the run must not stop its logging
                pass
        return inner

    def cancel_if_unopened(self) -> None:
        """``finish()`` is done with the backend: a run still being created must not outlive it."""
        if self.inner is None and self._gate is not None:
            self._gate.cancel()
