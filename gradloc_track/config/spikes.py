"""Spike detector and localizer configs (groups ``spikes`` and ``locate``)."""
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


@dataclass
class LocateConfig:
    enabled: bool = True
    method: str = "auto"  # auto | ghost | bisect
    budget: int = 128
    threshold: Optional[float] = None  # None = adaptive from the batch's per-token statistics
    max_events: int = 20  # localize at most this many spikes per run
    top_layers: int = 3

    def __post_init__(self) -> None:
        one_of("locate.method", self.method, ("auto", "ghost", "bisect"))
        check(self.budget >= 1, "locate.budget", self.budget, "use a positive number of probes")
        if self.threshold is not None:
            check(self.threshold > 0, "locate.threshold", self.threshold, "use a positive value or null")
