"""``finish()`` ran out of time: everything the writer still holds or has queued goes to the spool.

In the order it was logged: the record in flight (the backend may also have it; replay sends it
with its original timestamp, so MLflow's store drops the duplicate), the merged metrics by step,
the held record, then the rest of the queue. Queued jobs run here with their records spooled, or,
given a ``late`` list (``finish()``, which must keep its bound: a job renders a spike's page and
heatmap, seconds each), are put there for the caller to run off its thread.
``gradloc-track replay <run dir>`` completes the run from there.
"""
from __future__ import annotations

import queue

from typing import Any, Callable

from .pending import FLUSH, STOP, Leftovers, PendingRecords
from .spill import Spill

#: a job not run yet: (job, its enqueue time)
LateJob = tuple[Callable[[Any], None], int]


def hand_over(q: queue.Queue, pending: PendingRecords, spill: Spill, reason: str,
              late: list[LateJob] | None = None) -> bool:
    """Spool everything left; ``True`` when a final status was among it (spooled or in flight). Jobs go
    to ``late`` when given, else run here."""
    left = pending.take_over(reason)
    saw_finish = _spool_leftovers(left, spill, reason, late)
    saw_finish = _spool_queue(q, spill, reason, late) or saw_finish
    return saw_finish or (left.inflight is not None and left.inflight[0] == "finish")


def _job(job: Callable[[Any], None], ts: int, spill: Spill, reason: str, late: list[LateJob] | None) -> None:
    if late is not None:
        late.append((job, ts))
    else:
        spill.run_job(job, reason, ts)


def _spool_leftovers(left: Leftovers, spill: Spill, reason: str, late: list[LateJob] | None) -> bool:
    if left.inflight is not None:
        call, args, ts = left.inflight
        spill(call, args, ts, f"{reason} (in flight: the backend may also have it)")
    for record in left.metrics:
        spill(*record, reason)
    if left.held is None:
        return False
    call, args, ts = left.held  # queued after those metrics, before the rest
    if call == "submit":
        _job(args[0], ts, spill, reason, late)
        return False
    spill(call, args, ts, reason)
    return call == "finish"


def _spool_queue(q: queue.Queue, spill: Spill, reason: str, late: list[LateJob] | None) -> bool:
    saw_finish = False
    while True:
        try:
            call, args, ts = q.get_nowait()
        except queue.Empty:
            return saw_finish
        try:
            if call == "submit":
                _job(args[0], ts, spill, reason, late)
            elif call is not STOP and call is not FLUSH:  # (markers: nothing to keep)
                saw_finish = saw_finish or call == "finish"
                spill(call, args, ts, reason)
        finally:
            q.task_done()
