"""``finish()`` ran out of time: everything the writer still holds or has queued goes to the spool.

In the order it was logged: the record in flight (the backend may also have it; replay sends it
with its original timestamp, so MLflow's store drops the duplicate), the merged metrics by step,
the held record, then the rest of the queue. Queued jobs run here with their records spooled.
``gradloc-track replay <run dir>`` completes the run from there.
"""
from __future__ import annotations

import queue

from .pending import FLUSH, STOP, Leftovers, PendingRecords
from .spill import Spill


def hand_over(q: queue.Queue, pending: PendingRecords, spill: Spill, reason: str) -> bool:
    """Spool everything left; ``True`` when a final status was among it (spooled or in flight)."""
    left = pending.take_over(reason)
    saw_finish = _spool_leftovers(left, spill, reason)
    saw_finish = _spool_queue(q, spill, reason) or saw_finish
    return saw_finish or (left.inflight is not None and left.inflight[0] == "finish")


def _spool_leftovers(left: Leftovers, spill: Spill, reason: str) -> bool:
    if left.inflight is not None:
        call, args, ts = left.inflight
        spill(call, args, ts, f"{reason} (in flight: the backend may also have it)")
    for record in left.metrics:
        spill(*record, reason)
    if left.held is None:
        return False
    call, args, ts = left.held  # queued after those metrics, before the rest
    if call == "submit":
        spill.run_job(args[0], reason, ts)
        return False
    spill(call, args, ts, reason)
    return call == "finish"


def _spool_queue(q: queue.Queue, spill: Spill, reason: str) -> bool:
    saw_finish = False
    while True:
        try:
            call, args, ts = q.get_nowait()
        except queue.Empty:
            return saw_finish
        try:
            if call == "submit":
                spill.run_job(args[0], reason, ts)
            elif call is not STOP and call is not FLUSH:  # (markers: nothing to keep)
                saw_finish = saw_finish or call == "finish"
                spill(call, args, ts, reason)
        finally:
            q.task_done()
