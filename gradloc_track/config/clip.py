"""Clipper configs (group ``clip``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ._validate import check, one_of

CLIP_KINDS = ("none", "global", "adagc", "zclip", "layerclip")
NONFINITE = ("skip", "zero", "raise")


@dataclass
class ClipConfig:
    kind: str = "none"
    on_nonfinite: str = "skip"
    # global
    max_norm: float = 1.0
    # adagc (defaults of the official PyTorch patch)
    lambda_rel: float = 1.04
    beta: float = 0.99
    warmup_steps: int = 100
    lambda_abs: float = 1.0
    eps: float = 1e-6
    # zclip (published defaults)
    alpha: float = 0.97
    z_thresh: float = 2.5
    zclip_warmup_steps: int = 25
    mode: str = "zscore"  # zscore | percentile
    clip_option: str = "adaptive_scaling"  # adaptive_scaling | mean
    # layerclip
    layer_z_thresh: float = 3.0
    layer_alpha: float = 0.97
    layer_warmup_steps: int = 25

    def __post_init__(self) -> None:
        one_of("clip.kind", self.kind, CLIP_KINDS)
        one_of("clip.on_nonfinite", self.on_nonfinite, NONFINITE)
        check(0.0 < self.beta < 1.0, "clip.beta", self.beta, "use a value strictly between 0 and 1")
        check(self.lambda_rel > 0, "clip.lambda_rel", self.lambda_rel, "use a positive value (e.g. 1.04)")
        check(self.lambda_abs > 0, "clip.lambda_abs", self.lambda_abs, "use a positive value (e.g. 1.0)")
        check(self.max_norm > 0, "clip.max_norm", self.max_norm, "use a positive value (e.g. 1.0)")
        check(self.warmup_steps >= 1, "clip.warmup_steps", self.warmup_steps,
              "use 1 or more: AdaGC warm-up steps initialise its per-tensor thresholds")
        check(0.0 < self.alpha < 1.0, "clip.alpha", self.alpha, "use a value strictly between 0 and 1")
        check(self.z_thresh > 0, "clip.z_thresh", self.z_thresh, "use a positive z-score (e.g. 2.5)")
        one_of("clip.mode", self.mode, ("zscore", "percentile"))
        one_of("clip.clip_option", self.clip_option, ("adaptive_scaling", "mean"))


@dataclass
class AdamCConfig:
    """Corrected weight decay (AdamC): lambda_t = lambda * lr_t / lr_max."""

    enabled: bool = False
    lr_max: Optional[float] = None  # None = the optimizer's initial lr
