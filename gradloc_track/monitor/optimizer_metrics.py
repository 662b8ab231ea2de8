"""``lr``, ``weight_decay`` and AdamC's steady-state ratio, read from the arguments or the optimizer."""
from __future__ import annotations

import math
from typing import Any


class OptimizerMetrics:
    """``lr`` at the step it applies; ``weight_decay`` when it changes; AdamC's ratio where it means something."""

    def __init__(self, optimizer: Any, adamc_ratio: bool | None) -> None:
        self.optimizer = optimizer
        self.adamc_ratio = adamc_ratio
        self._last_wd: float | None = None

    def read(self, lr: Any, weight_decay: Any) -> tuple[Any, Any]:
        """lr / weight_decay from the arguments, else from the optimizer's param groups."""
        groups = getattr(self.optimizer, "param_groups", None) or []
        if lr is None and groups:
            lr = groups[0].get("lr")
        if weight_decay is None and groups:
            adamc = getattr(self.optimizer, "adamc_weight_decay", None)
            if adamc is not None and adamc.corrected_groups:  # AdamC: the schedule-scaled groups' decay
                groups = [groups[i] for i in adamc.corrected_groups]
            decays = [g.get("weight_decay") for g in groups if g.get("weight_decay") is not None]
            if decays:  # no-decay groups (norms, biases) hold 0: the decayed groups' value is the one
                weight_decay = max(decays, key=float)
        return lr, weight_decay

    def metrics(self, lr: float | None, weight_decay: float | None) -> dict[str, float]:
        out: dict[str, float] = {}
        if lr is not None:
            out["lr"] = float(lr)
        if weight_decay is not None and float(weight_decay) != self._last_wd:
            out["weight_decay"] = self._last_wd = float(weight_decay)
        adamc = self.adamc_ratio
        if adamc is None:  # auto: only when AdamC's schedule-scaled decay drives this optimizer
            adamc = getattr(self.optimizer, "adamc_weight_decay", None) is not None
        if adamc and lr is not None and weight_decay is not None and float(lr) > 0 and float(weight_decay) > 0:
            out["adamc/steady_state_ratio"] = math.sqrt(2.0 * float(weight_decay) / float(lr))
        return out
