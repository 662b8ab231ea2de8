"""Clipper configs (group ``clip``)."""
from __future__ import annotations

import math
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
    warmup_steps: int = 100  # 0 = no warm-up (the official code accepts it)
    lambda_abs: float = 1.0
    eps: float = 1e-6  # adagc, zclip and layerclip
    adagc_mode: str = "tensor"  # tensor (AdaGC) | shard (AdaGC-Shard) | global (AdaGC-Global)
    # zclip (published defaults)
    alpha: float = 0.97
    z_thresh: float = 2.5
    zclip_warmup_steps: int = 25
    mode: str = "zscore"  # zscore | percentile
    clip_option: str = "adaptive_scaling"  # adaptive_scaling | mean
    clip_factor: float = 1.0  # multiplies the adaptive_scaling threshold
    # a fixed cap on top of ZClip, also in warm-up. null = none; the zclip package defaults to 1.0
    max_grad_norm: Optional[float] = None
    skip_update_on_spike: bool = False  # a clipped step does not update ZClip's EMA
    # layerclip
    layer_z_thresh: float = 3.0
    layer_alpha: float = 0.97
    layer_warmup_steps: int = 25

    def __post_init__(self) -> None:
        one_of("clip.kind", self.kind, CLIP_KINDS)
        one_of("clip.on_nonfinite", self.on_nonfinite, NONFINITE)
        _positive("clip.max_norm", self.max_norm, "1.0")
        _positive("clip.lambda_rel", self.lambda_rel, "1.04")
        _unit("clip.beta", self.beta, "0.99")
        _count("clip.warmup_steps", self.warmup_steps, 0, "100 (0 = no warm-up)")
        _positive("clip.lambda_abs", self.lambda_abs, "1.0")
        check(_real(self.eps) and math.isfinite(self.eps) and self.eps >= 0, "clip.eps", self.eps,
              "use a small non-negative number (e.g. 1e-6)")
        one_of("clip.adagc_mode", self.adagc_mode, ("tensor", "shard", "global"))
        _unit("clip.alpha", self.alpha, "0.97")
        _positive("clip.z_thresh", self.z_thresh, "2.5")
        _count("clip.zclip_warmup_steps", self.zclip_warmup_steps, 1, "25")
        one_of("clip.mode", self.mode, ("zscore", "percentile"))
        one_of("clip.clip_option", self.clip_option, ("adaptive_scaling", "mean"))
        _positive("clip.clip_factor", self.clip_factor, "1.0")
        if self.max_grad_norm is not None:
            _positive("clip.max_grad_norm", self.max_grad_norm, "1.0, or null for no fixed cap")
        one_of("clip.skip_update_on_spike", self.skip_update_on_spike, (True, False))
        _positive("clip.layer_z_thresh", self.layer_z_thresh, "3.0")
        _unit("clip.layer_alpha", self.layer_alpha, "0.97")
        _count("clip.layer_warmup_steps", self.layer_warmup_steps, 1, "25")


def _real(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _positive(field: str, v, example: str) -> None:
    check(_real(v) and math.isfinite(v) and v > 0, field, v, f"use a positive finite number (e.g. {example})")


def _unit(field: str, v, example: str) -> None:
    check(_real(v) and 0.0 < v < 1.0, field, v, f"use a value strictly between 0 and 1 (e.g. {example})")


def _count(field: str, v, minimum: int, example: str) -> None:
    check(isinstance(v, int) and not isinstance(v, bool) and v >= minimum, field, v,
          f"use a whole number >= {minimum} (e.g. {example})")


@dataclass
class AdamCConfig:
    """Corrected weight decay (AdamC): lambda_t = lambda * lr_t / lr_max, for programmatic use.

    Not a Hydra group: the example app reads ``optim.adamc`` and ``optim.adamc_lr_max``.
    """

    enabled: bool = False
    lr_max: Optional[float] = None  # the schedule's PEAK lr; None = read it from the scheduler

    def __post_init__(self) -> None:
        if self.lr_max is not None:
            _positive("adamc.lr_max", self.lr_max, "3e-4, the schedule's peak lr")
