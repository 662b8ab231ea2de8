"""What the writer thread holds between the queue and the backend, where ``finish()`` can take it over.

- metrics merged per step (many ``log_metrics`` calls for one step become one record), taken off
  one step at a time or, for a backend that takes many steps per request, as a batch of steps
  (``values`` counts what is pending, so the writer knows when a batch is full);
- the record in flight (a backend call running now; it may hang);
- the held record: a non-metrics record taken off the queue while the metrics queued before it
  are written (they may hang too).
One lock guards them and the ``abandoned`` reason, so when ``finish()`` gives up each record ends
in exactly one place: the backend, or the spool (once).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

#: one queued call: (method name, positional args, enqueue time in ms)
Record = tuple[Any, tuple, int]
#: queued last by ``finish()``: the writer thread ends when it takes this
STOP = object()
#: queued by ``flush()``: every metric merged so far is written before this record is done
FLUSH = object()


def now_ms() -> int:
    return int(time.time() * 1000)


@dataclass
class Leftovers:
    """What ``finish()`` took over from the writer, in the order it was logged."""

    inflight: Record | None = None
    metrics: list[Record] = field(default_factory=list)  # ("log_metrics", (metrics, step), first ts), by step
    held: Record | None = None


class PendingRecords:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.abandoned: str | None = None  # why finish() gave up on the writer; set once, never cleared
        self._metrics: dict[int, tuple[dict[str, Any], int]] = {}  # step -> (merged metrics, first ts)
        self.values = 0  # metric values pending, all steps together
        self._inflight: Record | None = None
        self._inflight_spooled = False
        self._held: Record | None = None

    def __len__(self) -> int:
        return len(self._metrics)

    def merge(self, metrics: dict[str, Any], step: int, ts: int) -> bool:
        """Add ``metrics`` to ``step``'s pending ones; ``False`` once abandoned (the caller spools them)."""
        with self._lock:
            if self.abandoned is not None:
                return False
            merged, first_ts = self._metrics.get(step, ({}, ts))
            before = len(merged)
            merged.update(metrics)
            self.values += len(merged) - before
            self._metrics[step] = (merged, first_ts)
            return True

    def pop_first(self) -> Record | None:
        """The lowest pending step, as a ``log_metrics`` record (what is left stays visible to ``take_over``)."""
        with self._lock:
            if not self._metrics:
                return None
            step = min(self._metrics)
            metrics, ts = self._metrics.pop(step)
            self.values -= len(metrics)
        return "log_metrics", (metrics, step), ts

    def pop_batch(self, max_metrics: int) -> Record | None:
        """The lowest pending steps, in order, as one ``log_metric_records`` record of
        ``(metrics, step, ts)`` entries: as many steps as fit in ``max_metrics`` values (at least one)."""
        with self._lock:
            batch, size = [], 0
            for step in sorted(self._metrics):
                metrics, ts = self._metrics[step]
                if batch and size + len(metrics) > max_metrics:
                    break
                batch.append((metrics, step, ts))
                size += len(metrics)
                del self._metrics[step]
            self.values -= size
        return ("log_metric_records", (batch,), batch[0][2]) if batch else None

    def hold(self, record: Record) -> None:
        with self._lock:
            self._held = record

    def peek_held(self) -> Record | None:
        """The held record, left held."""
        with self._lock:
            return self._held

    def unhold(self) -> Record | None:
        """The held record back; ``None`` when ``finish()`` gave up meanwhile and spooled it in order."""
        with self._lock:
            held, self._held = self._held, None
        return held

    def take_off(self, record: Record) -> str | None:
        """Mark ``record`` in flight; returns the abandon reason instead when ``finish()`` gave up."""
        with self._lock:
            if self.abandoned is None:
                self._inflight, self._inflight_spooled = record, False
            return self.abandoned

    def land(self) -> bool:
        """The call in flight returned; ``True`` when ``finish()`` already spooled its record."""
        with self._lock:
            self._inflight = None
            return self._inflight_spooled

    def take_over(self, reason: str) -> Leftovers:
        """``finish()`` gives up: everything held here is the caller's to spool; nothing more is accepted."""
        with self._lock:
            self.abandoned = reason
            metrics, self._metrics, self.values = self._metrics, {}, 0
            inflight = self._inflight
            self._inflight_spooled = inflight is not None
            held, self._held = self._held, None
        ordered = [("log_metrics", (metrics[s][0], s), metrics[s][1]) for s in sorted(metrics)]
        return Leftovers(inflight, ordered, held)
