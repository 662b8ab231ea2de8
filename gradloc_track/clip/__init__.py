"""Gradient clippers: AdaGC, ZClip, LayerClip, GlobalClip, NoClip.

Each clips ``p.grad`` in place with ``clip()`` and returns a ``ClipResult`` whose thresholds and
coefficients can be logged; the monitor passes the norms it already computed (``clip(sq_norms)``).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from ..config.clip import CLIP_SCHEMAS
from .adagc import AdaGC
from .clipper import CLIPPERS, Clipper, ClipResult
from .layerclip import LayerClip
from .simple import GlobalClip, NoClip
from .skip_step import SkipStepGuard
from .zclip import ZClip

__all__ = ["AdaGC", "ZClip", "LayerClip", "GlobalClip", "NoClip", "Clipper", "ClipResult", "SkipStepGuard",
           "build_clipper", "CLIPPERS"]


def build_clipper(cfg: Any, model: torch.nn.Module, process_group: Any = None) -> Clipper | None:
    """The clipper a clip schema names (``AdaGCConfig``, ``ZClipConfig``, ..., or a composed
    ``clip`` node); ``None`` for ``clip=none`` (the monitor's own skip guard handles a non-finite
    step), or a measuring ``NoClip`` when ``clip=none`` asks for another non-finite handling
    (``clip.on_nonfinite``, ``clip.skip_step``: ``off`` opts out of the skip)."""
    if not dataclasses.is_dataclass(cfg):  # a Hydra node: build its schema (runs its checks)
        from omegaconf import OmegaConf

        cfg = OmegaConf.to_object(cfg) if OmegaConf.is_config(cfg) else cfg
    if not dataclasses.is_dataclass(cfg):
        raise TypeError(f"build_clipper(cfg=...) takes a clip schema such as gradloc_track.config.AdaGCConfig, "
                        f"got {type(cfg).__name__}")
    if cfg.kind == "none" and (cfg.on_nonfinite, cfg.skip_step) == ("skip", "auto"):
        return None
    if cfg.kind not in CLIPPERS:
        raise ValueError(f"clip.kind={cfg.kind!r} is unknown: use {', '.join(CLIP_SCHEMAS)}")
    clipper = CLIPPERS[cfg.kind]
    if not isinstance(cfg, clipper.Schema):  # the base ClipConfig() is clip=none: NoClipConfig, same fields
        cfg = clipper.Schema(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)})
    return clipper(model, cfg, process_group=process_group)  # a clipper is built from its schema
