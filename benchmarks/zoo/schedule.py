"""When a held-out zoo run injects, and the learning-rate schedule every family shares.

Injection steps are written for a 300-step run (``FULL``) and scaled to a shorter one (``--quick``):
three steps for the data and numeric kinds (and their placebo), two for the lr x50 (each with its
20-step aftermath), one for the cosine restart and the flipped weight (every later step is their
aftermath), and every fourth step from 100 to 256 for the leaked labels (a harm that builds up).
The localizer runs at injected steps and the ``LOCATE_AFTER`` steps after each (the aftermath's
causes use its evidence), nowhere else (it changes nothing in training; elsewhere it only costs).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from gradloc_track.config import LocateConfig

FULL = 300
THREE = (150, 200, 250)
LABELS = tuple(range(100, 260, 4))
AT = {"lr_x50": (150, 250), "cosine_restart": (200,), "weight_bitflip": (200,), "labels_leaked": LABELS,
      "placebo_labels": LABELS}
NONE = ("clean", "converged")
LOCATE_AFTER = 10
HORIZON = 250  # of FULL: the cosine is near its floor by the restart (lr x5 there)


@dataclass(frozen=True)
class Plan:
    at: tuple[int, ...]
    placebo: str = ""  # the control run of the same steps ("" = the clean twin)
    restart: int | None = None  # cosine_restart: the lr goes to its peak here and stays

    @classmethod
    def of(cls, kind: str, steps: int, full: int = FULL) -> "Plan":
        if kind in NONE:
            return cls(())
        raw = AT.get(kind, THREE)
        at = tuple(sorted({max(1, round(t * steps / full)) for t in raw}))
        placebo = "placebo_labels" if raw == LABELS else ("placebo" if raw == THREE else "")
        return cls(at, "" if kind.startswith("placebo") else placebo, at[0] if kind == "cosine_restart" else None)

    def twin_lr(self, t: int, warmup: int, horizon: int, offset: int = 0) -> float:
        """The clean twin's learning rate over this run's at scheduler step ``t`` (1 but after a restart);
        ``offset``: how far the run's step numbers are ahead of the scheduler's (Trainer's: 1)."""
        if self.restart is None:
            return 1.0
        restart = self.restart - offset
        return lr_factor(t, warmup, horizon) / lr_factor(t, warmup, horizon, restart)

    def locate_config(self, step: int) -> LocateConfig:
        on = any(0 <= step - a <= LOCATE_AFTER for a in self.at)
        return LocateConfig(enabled=on, max_events=10 ** 6)


def horizon(steps: int, full: int = FULL) -> int:
    """The cosine's length for a family whose scenario runs are ``steps`` long (twins share it)."""
    return max(1, round(HORIZON * steps / full))


def lr_factor(t: int, warmup: int, horizon: int, restart: int | None = None) -> float:
    """Linear warm-up, then a cosine from 1 to 0.1 over ``horizon`` steps; from ``restart`` on, 1 (the peak)."""
    if restart is not None and t >= restart:
        return 1.0
    warm = min(1.0, (t + 1) / warmup)
    return warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t / horizon))))
