"""The background writer's sizes and waits, in one value (``TrackerConfig`` names the same fields).

Every wait is clamped to ``threading.TIMEOUT_MAX`` here, once, so nothing downstream can pass a
lock a wait it cannot make (``TrackerConfig`` already rejects such values; a direct caller may not).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from ..bounded import clamp_wait

if TYPE_CHECKING:
    from ...config import TrackerConfig


@dataclass
class WriterSettings:
    """``queue_size`` records held before the producer spills; metrics are written every
    ``flush_interval_s`` (or when a batch is full); each backend call waits at most ``call_timeout_s``
    (quick failures retried ``retries`` times, ``retry_backoff_s`` apart), opening the run
    ``open_timeout_s``; a down backend is probed every ``probe_interval_s``; ``finish()`` returns
    within ``finish_timeout_s``; a producer waits at most ``put_timeout_s`` for room in the queue."""

    queue_size: int = 10000
    flush_interval_s: float = 1.0
    retries: int = 3
    retry_backoff_s: float = 0.5
    put_timeout_s: float = 0.05
    call_timeout_s: float = 10.0
    finish_timeout_s: float = 120.0
    probe_interval_s: float = 30.0
    open_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name.endswith("_s"):
                setattr(self, f.name, clamp_wait(getattr(self, f.name)))

    @classmethod
    def from_config(cls, cfg: "TrackerConfig") -> "WriterSettings":
        """The fields a ``TrackerConfig`` sets (``put_timeout_s`` keeps its default)."""
        return cls(**{f.name: getattr(cfg, f.name) for f in fields(cls) if hasattr(cfg, f.name)})
