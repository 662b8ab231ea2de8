"""A rank left waiting at the detector's all-gather is told why (held-out distributed tester, stop 54).

Under DDP ``optimizer.step()`` makes no collective call of its own, so a loop may skip it on one rank
(a per-rank ``if torch.isfinite(loss): opt.step()``) and nothing hangs. With the detector on, every
optimizer step all-gathers the ranks' losses (``rank_inputs``): a rank that skips the step leaves the
others waiting there until the process group's timeout (gloo: 30 minutes), and they then die on a bare
transport error. So:

- ``waiting(...)``: while this rank has waited there longer than ``WARN_AFTER_S``, one warning says what
  it waits for and the likely cause (a watcher thread, started on first use, wakes every few seconds; the
  wait itself costs two attribute writes). A rank that is only slow (saving a checkpoint) is harmless, and
  the warning says so.
- ``explained(exc)``: the collective's failure (the process group's timeout) re-raised with the fix.
"""
from __future__ import annotations

import threading
import time
import warnings
from contextlib import contextmanager
from typing import Iterator

WARN_AFTER_S = 120.0  # well above a slow rank's ordinary lag, well below gloo's 30-minute default timeout

WHY = ("watch()'s spike detector combines every rank's losses at optimizer.step() (one all-gather a step), so "
       "every rank must call optimizer.step() (or handle.step()) on the same steps. A rank that skipped it (a "
       "per-rank `if torch.isfinite(loss): opt.step()`: leave that to watch(), which skips a non-finite step on "
       "every rank together) leaves the others waiting until the process group's timeout")


class _Watcher:
    """The one wait in progress on this process (its description, start and number), and the thread that
    warns. Each wait has its own number, so a warning decided for a wait that has just ended never marks the
    next one as warned (review, stop 54)."""

    def __init__(self) -> None:
        self.what: str | None = None
        self.since = 0.0
        self.number = 0  # of the current (or last) wait
        self.warned = 0  # the number of the last wait warned about
        self.thread: threading.Thread | None = None
        self.lock = threading.Lock()

    def start(self) -> None:
        with self.lock:
            if self.thread is None or not self.thread.is_alive():  # a forked child has no thread
                self.thread = threading.Thread(target=self._run, name="gradloc-rank-wait", daemon=True)
                self.thread.start()

    def begin(self, what: str) -> None:
        self.number += 1
        self.since, self.what = time.monotonic(), what  # ``what`` last: the watcher reads it first

    def _run(self) -> None:
        while True:
            time.sleep(min(5.0, max(0.05, WARN_AFTER_S / 4)))
            what, number, since = self.what, self.number, self.since
            waited = time.monotonic() - since
            if what is None or self.warned == number or waited < WARN_AFTER_S or number != self.number:
                continue
            self.warned = number
            warnings.warn(f"gradloc-track: {what} has waited {waited:.0f} s for the other ranks. {WHY}. A rank "
                          f"that is only slow (saving a checkpoint, an evaluation on one rank) is harmless.",
                          RuntimeWarning, stacklevel=1)


_watcher = _Watcher()


@contextmanager
def waiting(what: str) -> Iterator[None]:
    """Mark a wait for the other ranks (``what``: who waits, where) for the watcher (module doc)."""
    if _watcher.thread is None or not _watcher.thread.is_alive():
        _watcher.start()
    _watcher.begin(what)
    try:
        yield
    finally:
        _watcher.what = None


def explained(exc: BaseException, rank: int) -> BaseException:
    """The error a failed all-gather of the detector's inputs is re-raised as (``raise ... from exc``): the
    same class (a ``DistBackendError`` stays one, for code that catches it), its message first, then the
    likely cause."""
    text = (f"{exc} [gradloc-track: rank {rank}'s all-gather of the spike detector's inputs at optimizer.step() "
            f"failed. Likely cause: {WHY}. Did a rank skip optimizer.step(), leave the loop early or die?]")
    try:
        return type(exc)(text)
    except Exception:  # a class that does not take one message
        return RuntimeError(text)
