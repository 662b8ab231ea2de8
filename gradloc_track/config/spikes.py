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
    # fire above this z-score (raised by tail_correction where the noise is heavy-tailed). 8, up from 6 (stop 59):
    # chosen on the dev half widened with C headers, Debian changelogs and packed mixed documents, whose clean
    # runs fired where pydoc's almost never did (the global norm 2.05-2.16x at z 6.9-7.3 on a rare token);
    # every dev family keeps recall >= 95% (docs/benchmarks.md, "the dev half widened")
    z_thresh: float = 8.0
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
    # the global norm also fires when its z without the tail correction passes broad_z and so does the z of at
    # least broad_share of the layers read this step (null = off; needs per_layer): junk targets in a few rows move
    # the global norm to z 7-10 and most layers past z 5, under z_thresh x a heavy tail's correction (1.2-1.55 on
    # code), while a clean rare token moves one or two layers. Layers without a z this step (warm-up, no gradient)
    # are not counted.
    # 5 and 0.5 (stop 60): on the dev half, widened with Perl source and a harmful token kind, the most harmful
    # steps found (89 -> 98 of 109) with no more false events (4 in 24524 clean steps); docs/benchmarks.md
    broad_z: Optional[float] = 5.0
    broad_share: float = 0.5
    # steps each signal only learns before it may fire: the first steps of pretraining are wild (norms
    # rise 6% a step, embeddings spike 10x in clean data); RL from a trained policy needs fewer
    # (the TRL callback's RL defaults: 20)
    warmup_steps: int = 50
    # ... and for the gradient norms alone, past warmup_steps, while the loss still falls faster than
    # transient_fall times its fastest fall so far (the loss signal's trend), up to 4 x warmup_steps: early
    # training's transient (norms that jump as the model leaves its first plateau, with no loss, junk or
    # update signal beside them) is not an event unless the step's own norm passes ratio_thresh (one small
    # layer's ratio, the position embedding's 81x beside the step's 2.8x, does not count); 0 = warmup_steps
    # alone. Needs the step's loss (watch(), the HF callback, after_backward(loss=...)). Chosen on the held-out
    # zoo's dev half: 0.1 takes the HF models' clean false events from 7 to 3 in 6600 steps, every harmful
    # step still found (0.25 before)
    transient_fall: float = 0.1
    per_layer: bool = True
    # signals beyond the gradient norms (issue 26), each read when the step provides it:
    # the step's loss (GradMonitor.after_backward(loss=...); watch() and the HF callback read the model's own)
    loss_signal: bool = True
    # the largest per-sample loss (after_backward(sample_losses=...)): one bad sample among many
    sample_signal: bool = True
    # the update the optimizer is about to make (Adam-like optimizers known to the monitor): a learning-rate
    # jump, a tensor whose second moment decayed below its gradient
    update_signal: bool = True
    # z-score threshold of the two loss signals: a batch loss is an average over many tokens, its noise
    # lighter-tailed than a small batch's gradient norm, and the min ratios below guard it. 5, up from 4 (stop 59,
    # chosen with z_thresh): a batch of one unusual document reads 1.2x at z 5-6; the demo's mild_3of8 keeps 28 of
    # its 30 steps
    loss_z_thresh: float = 5.0
    # the loss must also exceed loss_min_ratio x its running mean (a batch loss moves far less than a norm)
    loss_min_ratio: float = 1.15
    # the largest per-sample loss must also exceed sample_min_ratio x its running mean (clean batches
    # hold odd samples: a table, a hex dump)
    sample_min_ratio: float = 1.5
    # ... and each must also rise at least this many nats above its running mean (loss= and sample_losses= are
    # means over loss terms, in nats): where the model has memorised its data (a loss of 0.1), a clean batch at
    # 0.18 is 1.8x its mean with a z of 5-6 (held-out testers, stops 57-58: 3-10 events per clean run). Chosen on
    # the development side (spike zoo, held-out zoo's dev half) as half the smallest rise on a harmful step only
    # the losses fired on (0.46 and 1.68 nats); 0 = off
    loss_min_rise: float = 0.2
    sample_min_rise: float = 0.8
    # a run of loss terms the model rates below chance (spikes.junk): a garbled span inside a clean
    # sample, invisible to the sample's mean loss and to the norms (after_backward(junk_span=...);
    # watch() and the HF callback measure it from the model's logits)
    junk_signal: bool = True
    junk_terms: int = 16  # the run's length in loss terms
    # fire when those terms average more than junk_margin nats above a random token's loss (spike zoo:
    # clean 16-term runs +0.04 at most, garbled spans +0.27 and up)
    junk_margin: float = 0.1
    # the optimizer's update also fires above update_ratio_thresh x its running mean, whatever its noise
    # (null = off): Adam normalises its step, so clean steps stay within ~2x (spike zoo: 2.24 at most in
    # 9156 clean steps), while a lost optimizer state or a learning-rate jump moves it 3-10x
    update_ratio_thresh: Optional[float] = 3.0
    # z-score threshold of the update signal: 6, where z_thresh was before it rose to 8 (stop 59). The dev zoo
    # reads the same at 6 or 8 on the update, and a lost optimizer state or a decayed second moment reads
    # z 8-9.4 on a small model (tests/monitor/test_cause_evidence.py): at 8 x its tail correction both went unseen
    update_z_thresh: float = 6.0
    # a gradient norm below noise_floor x the parameter norm is float noise (RL groups whose gradients
    # cancel): no event, not counted; 0 = off
    noise_floor: float = 1e-7
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
              "use a positive, finite z-score (e.g. 8)")
        check(1.0 <= self.min_ratio < float("inf"), "spikes.min_ratio", self.min_ratio,
              "use a ratio of 1 or more (e.g. 1.5; 1 = no guard)")
        if self.ratio_thresh is not None:
            check(self.ratio_thresh > 1.0, "spikes.ratio_thresh", self.ratio_thresh,
                  "use a ratio above 1 (e.g. 10), or null to turn the ratio rule off")
        if self.update_ratio_thresh is not None:
            check(1.0 < self.update_ratio_thresh < float("inf"), "spikes.update_ratio_thresh",
                  self.update_ratio_thresh, "use a ratio above 1 (e.g. 3), or null to turn the rule off")
        if self.broad_z is not None:
            check(0 < self.broad_z < float("inf"), "spikes.broad_z", self.broad_z,
                  "use a positive, finite z-score (e.g. 5), or null to turn the broad rule off")
        check(0.0 < self.broad_share <= 1.0, "spikes.broad_share", self.broad_share,
              "use a share of the layers in (0, 1] (e.g. 0.5)")
        check(self.warmup_steps >= 0, "spikes.warmup_steps", self.warmup_steps, "use 0 or more")
        check(0.0 <= self.transient_fall < 1.0, "spikes.transient_fall", self.transient_fall,
              "use a fraction in [0, 1) of the loss's fastest fall (e.g. 0.25), or 0 for warmup_steps alone")
        for name, example in (("loss_z_thresh", 5), ("update_z_thresh", 6)):
            value = getattr(self, name)
            check(0 < value < float("inf"), f"spikes.{name}", value, f"use a positive, finite z-score (e.g. {example})")
        for name in ("loss_min_ratio", "sample_min_ratio"):
            value = getattr(self, name)
            check(1.0 <= value < float("inf"), f"spikes.{name}", value, "use a ratio of 1 or more (1 = no guard)")
        for name in ("loss_min_rise", "sample_min_rise"):
            value = getattr(self, name)
            check(0.0 <= value < float("inf"), f"spikes.{name}", value,
                  "use 0 (off) or a rise in nats above the running mean (e.g. 0.2)")
        check(self.junk_terms >= 1, "spikes.junk_terms", self.junk_terms,
              "use a run of 1 or more loss terms (e.g. 16)")
        check(-float("inf") < self.junk_margin < float("inf"), "spikes.junk_margin", self.junk_margin,
              "use a finite margin in nats a term above chance (e.g. 0.1)")
        check(0.0 <= self.noise_floor < 1.0, "spikes.noise_floor", self.noise_floor,
              "use a small fraction of the parameter norm (e.g. 1e-7), or 0 to turn the floor off")
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
