"""Backend health: up, down (records go straight to the spool), probed again every ``probe_interval_s``.

Down after a call failed or timed out, so a dead server costs one bounded wait, not one per record.
The writer keeps two: the backend's, and its artifact store's (``writer.ARTIFACT_CALLS``: a store that refuses
writes, a read-only folder or a bucket without permission, keeps the spike files in the spool while metrics,
params and the run's status go on).
A probe waits until the stuck call has returned: never two SDK calls at once. A stuck call that
turns out to have succeeded makes the next record a probe at once.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from pathlib import Path

from ..bounded import CallTimeout

log = logging.getLogger(__name__)


class BackendHealth:
    def __init__(self, name: str, probe_interval_s: float, spool_path: Path, label: str | None = None) -> None:
        self.name, self.probe_interval_s, self.spool_path = name, probe_interval_s, spool_path
        self.label = label or f"{name} tracker"  # what the log calls down and back (``<name> artifact store``)
        self.healthy = True
        self.reason: str | None = None  # why records are spooled while down
        self.reason_first: str | None = None  # the first failure (what the closing lines name)
        self.stuck: Future | None = None  # the last call that timed out (it may still return)
        self._next_probe = 0.0

    def may_call(self, caller_busy: bool) -> bool:
        """True when the backend may be called now: it is up, or a probe is due and no call is stuck."""
        if self.healthy:
            return True
        stuck = self.stuck
        if stuck is not None and stuck.done() and stuck.exception() is None:
            self.stuck, self._next_probe = None, 0.0  # the slow call got through after all: try now
        return time.monotonic() >= self._next_probe and not caller_busy

    def down(self, exc: BaseException) -> None:
        if self.healthy:
            log.warning("%s down (%r); spooling to %s, probing every %g s", self.label, exc,
                        self.spool_path, self.probe_interval_s)
        if isinstance(exc, CallTimeout):
            self.stuck = exc.future
        self.healthy = False
        self.reason = f"backend down since an earlier call failed: {exc!r}"
        if self.reason_first is None:
            self.reason_first = repr(exc)
        self._next_probe = time.monotonic() + self.probe_interval_s

    def up(self) -> None:
        if not self.healthy:
            log.warning("%s is back", self.label)
        self.healthy, self.reason = True, None
