"""Early training's transient: past the warm-up the loss may still fall fast, and gradient norms jump
with it. While it lasts, norm-only jumps under the safety net do not fire (``spikes.transient_fall``)."""
from __future__ import annotations

from typing import Any

from .signal import LogSignal


class Transient:
    """The loss's fastest fall per step so far (log space); the transient ends, for good, at the first
    step past the warm-up whose fall is slower than ``fall`` of it, and after 4 warm-ups at the latest."""

    def __init__(self, fall: float, warmup_steps: int) -> None:
        self.fall, self.warmup = fall, max(1, warmup_steps)
        self.fall_max = 0.0
        self.over = False

    def active(self, loss: LogSignal | None) -> bool:
        """Past the warm-up, is the loss (its ``LogSignal``) still in early training's fall?"""
        if self.fall <= 0 or self.over or loss is None or loss.n < self.warmup:
            return False
        return loss.n < 4 * self.warmup and -loss.trend > self.fall * self.fall_max

    def follow(self, loss: LogSignal | None, metrics: dict[str, float]) -> None:
        """Take in this step's fall; ``spike/transient`` is 1 while the transient lasts, 0 once it has ended
        (also in a run resumed after it ended: the key no longer comes and goes with a resume)."""
        if loss is None or self.fall <= 0:
            return
        if self.over:
            metrics["spike/transient"] = 0.0
            return
        self.fall_max = max(self.fall_max, -loss.trend)
        inside = self.active(loss)
        metrics["spike/transient"] = float(inside)
        self.over = loss.n >= self.warmup and not inside

    def state(self) -> tuple[float, bool]:
        return self.fall_max, self.over

    def load(self, state: Any) -> None:
        # a state from before the transient rule: that run is past its transient
        self.fall_max, self.over = state if state is not None else (0.0, True)
