"""Spike detector config (group ``spikes``); the localizer's is in ``locate.py``."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ._validate import check, one_of


@dataclass
class SpikeConfig:
    enabled: bool = True
    mode: str = "adaptive"  # adaptive (EMA z-score) | fixed (GradLoc per-token knob)
    alpha: float = 0.98  # EMA decay of mean/variance
    z_thresh: float = 6.0
    ratio_thresh: float = 3.0  # also fire when value > ratio_thresh * EMA mean
    warmup_steps: int = 20
    per_layer: bool = True
    # fixed mode: GradLoc-style per-token threshold; fires when global norm > thr / sqrt(n_tokens)
    per_token_threshold: Optional[float] = None
    score_window: int = 128  # OLMo-style spike score window (mean + 6 sigma of last N)

    def __post_init__(self) -> None:
        one_of("spikes.mode", self.mode, ("adaptive", "fixed"))
        check(0.0 < self.alpha < 1.0, "spikes.alpha", self.alpha, "use a value strictly between 0 and 1")
        check(self.z_thresh > 0, "spikes.z_thresh", self.z_thresh, "use a positive z-score")
        check(self.warmup_steps >= 0, "spikes.warmup_steps", self.warmup_steps, "use 0 or more")
        if self.mode == "fixed":
            check(self.per_token_threshold is not None and self.per_token_threshold > 0,
                  "spikes.per_token_threshold", self.per_token_threshold,
                  "fixed mode needs a positive per-token threshold")


from .locate import LocateConfig  # noqa: E402,F401  (moved to config/locate.py; kept importable here)
