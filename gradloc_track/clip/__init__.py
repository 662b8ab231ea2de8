"""Gradient clippers: AdaGC, ZClip, LayerClip, GlobalClip, NoClip.

Each clips ``p.grad`` in place with ``clip()`` and returns a ``ClipResult`` whose thresholds and
coefficients can be logged; the monitor passes the norms it already computed (``clip(sq_norms)``).
"""
from __future__ import annotations

from typing import Any

import torch

from .adagc import AdaGC
from .base import Clipper, ClipResult
from .layerclip import LayerClip
from .simple import GlobalClip, NoClip
from .skip_step import SkipStepGuard
from .zclip import ZClip

__all__ = ["AdaGC", "ZClip", "LayerClip", "GlobalClip", "NoClip", "Clipper", "ClipResult", "SkipStepGuard",
           "build_clipper"]


def build_clipper(cfg, model: torch.nn.Module, process_group: Any = None) -> Clipper | None:
    """The clipper a ``ClipConfig`` names; ``None`` for ``clip=none`` (nothing to do)."""
    common = {"on_nonfinite": cfg.on_nonfinite, "process_group": process_group}
    if cfg.kind == "none":
        return None
    if cfg.kind == "global":
        return GlobalClip(model, cfg.max_norm, **common)
    if cfg.kind == "adagc":
        return AdaGC(model, cfg.lambda_rel, cfg.beta, cfg.warmup_steps, cfg.lambda_abs, cfg.eps,
                     mode=cfg.adagc_mode, **common)
    if cfg.kind == "zclip":
        return ZClip(model, cfg.alpha, cfg.z_thresh, cfg.zclip_warmup_steps, cfg.mode, cfg.clip_option,
                     cfg.eps, clip_factor=cfg.clip_factor, max_grad_norm=cfg.max_grad_norm,
                     skip_update_on_spike=cfg.skip_update_on_spike, **common)
    if cfg.kind == "layerclip":
        return LayerClip(model, cfg.layer_z_thresh, cfg.layer_alpha, cfg.layer_warmup_steps, cfg.eps, **common)
    raise ValueError(f"clip.kind={cfg.kind!r} is unknown: use none, global, adagc, zclip or layerclip")
