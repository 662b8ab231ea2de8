"""Spike detector config (group ``spikes``); the localizer's is in ``locate.py``."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ._validate import check, check_types, one_of

RESPONSES = ("none", "surgery")


@dataclass
class SpikeConfig:
    enabled: bool = True
    mode: str = "adaptive"  # adaptive (EMA z-score of log norms) | fixed (GradLoc's per-token knob)
    alpha: float = 0.99  # EMA decay of the variance and tails (about 1/(1-alpha) = 100 steps of memory)
    baseline_alpha: float = 0.9  # EMA decay of the baseline (~10 steps: follows early training's fall)
    z_thresh: float = 6.0  # fire above this z-score (raised by tail_correction where the noise is heavy-tailed)
    # the value must also exceed min_ratio x its running (geometric) mean: a very steady signal
    # does not fire on a tiny absolute wobble
    min_ratio: float = 1.5
    # also fire when value > ratio_thresh x running mean whatever the noise (null = off): a safety
    # net for huge jumps while the noise estimate is inflated. Keep it large: at 4x32 tokens a clean
    # layer norm jumps 3-10x (0.1's default of 3 fired 40 times in 2000 clean steps)
    ratio_thresh: Optional[float] = 20.0
    # scale z_thresh by (kurtosis/3)^(1/4): small batches give heavy-tailed norms (a few tokens
    # dominate the batch gradient), and this keeps the chance of a false alarm at the Gaussian level
    tail_correction: bool = True
    warmup_steps: int = 20
    per_layer: bool = True
    # fixed mode: GradLoc's trigger, global norm > per_token_threshold / sqrt(n_tokens) * n_micro_batches
    per_token_threshold: Optional[float] = None
    score_window: int = 128  # OLMo-style spike score window (mean + 6 sigma of the last N values)
    # what a detected, localized spike does to the step: none (report it; the clipper, if any, treats
    # the step) | surgery (the culprits' exact gradient is removed from the step's before the
    # clipper runs; gradloc_track.localizer.surgery)
    response: str = "none"
    # skip, within a run, a sample already blamed for a spike when it comes again (next epoch, a
    # replay buffer): the data path asks ``gradloc_track.data.Quarantine`` (the demo does; docs/ledger.md)
    quarantine: bool = False

    def __post_init__(self) -> None:
        check_types(self, "spikes")
        one_of("spikes.mode", self.mode, ("adaptive", "fixed"))
        one_of("spikes.response", self.response, RESPONSES)
        check(0.0 < self.alpha < 1.0, "spikes.alpha", self.alpha, "use a value strictly between 0 and 1")
        check(0.0 < self.baseline_alpha < 1.0, "spikes.baseline_alpha", self.baseline_alpha,
              "use a value strictly between 0 and 1")
        check(0 < self.z_thresh < float("inf"), "spikes.z_thresh", self.z_thresh,
              "use a positive, finite z-score (e.g. 6)")
        check(1.0 <= self.min_ratio < float("inf"), "spikes.min_ratio", self.min_ratio,
              "use a ratio of 1 or more (e.g. 1.5; 1 = no guard)")
        if self.ratio_thresh is not None:
            check(self.ratio_thresh > 1.0, "spikes.ratio_thresh", self.ratio_thresh,
                  "use a ratio above 1 (e.g. 10), or null to turn the ratio rule off")
        check(self.warmup_steps >= 0, "spikes.warmup_steps", self.warmup_steps, "use 0 or more")
        check(self.score_window >= 2, "spikes.score_window", self.score_window,
              "use 2 or more steps (OLMo-core uses 128)")
        if self.per_token_threshold is not None:
            check(0 < self.per_token_threshold < float("inf"), "spikes.per_token_threshold",
                  self.per_token_threshold, "use a positive per-token threshold (GradLoc: 100 default, 640 "
                  "in their run), or null")
        if self.mode == "fixed":
            check(self.per_token_threshold is not None, "spikes.per_token_threshold", self.per_token_threshold,
                  "spikes.mode=fixed needs a positive per-token threshold (GradLoc: 100 default, 640 in their run)")


def check_response(spikes: SpikeConfig, locate_enabled: bool) -> None:
    """``spikes.response=surgery`` acts on what the detector fires on and the localizer names."""
    if spikes.response != "surgery":
        return
    check(spikes.enabled, "spikes.enabled", spikes.enabled,
          "spikes.response=surgery needs the detector: set spikes.enabled=true (or spikes.response=none)")
    check(locate_enabled, "locate.enabled", locate_enabled,
          "spikes.response=surgery removes the culprits the localizer names: set locate.enabled=true "
          "(or spikes.response=none)")


from .locate import LocateConfig  # noqa: E402,F401  (moved to config/locate.py; kept importable here)
