"""Clipper configs (group ``clip``): one schema per option, with the clipper's own argument names.

``conf/clip/<option>.yaml`` names its schema (stored as ``schema/clip/<option>``, outside the
``clip`` group, so ``clip=schema`` is not an option). The root config types its ``clip`` node as
``ClipConfig``, the fields every option has; each option's schema subclasses it, so Hydra merges
the chosen option's schema into that node and a key of another clipper (``clip=adagc
clip.alpha=0.9``) fails at composition. ``ClipConfig()`` on its own is ``clip=none``.

The kinds are one table, ``CLIP_SCHEMAS`` (``KIND`` -> schema), filled by the schemas themselves: a
subclass that declares its own ``KIND`` is the option ``clip=<KIND>``. What else a kind needs is said
once, on its schema (``ONE_THRESHOLD``, ``LOOSEN``); its clipper names the schema it is built from
(``clip.Clipper.Schema``), and ``clip.CLIPPERS`` is derived from that. A new kind: its schema here,
its clipper, ``conf/clip/<kind>.yaml``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

from ._validate import (check, check_types, in_unit_interval, integer, non_negative, one_of,
                        positive)

EPS_MAX = 1e-2  # eps only guards a division: far below any gradient norm it is added to


def small_eps(field: str, value: float, example: str, allow_zero: bool) -> None:
    """A clipper's ``eps``: ``0 < eps <= 1e-2`` (``0 <= ...`` where a zero cannot divide by 0). Larger values
    scale every gradient toward 0 (AdaGC: ``thr / (||g|| + eps)``) or stop clipping altogether (ZClip,
    LayerClip: ``z = (g - mu) / (sigma + eps)`` never reaches the threshold), silently."""
    (non_negative if allow_zero else positive)(field, value, example)
    low = "0 <=" if allow_zero else "0 <"
    check(value <= EPS_MAX, field, value, f"use {low} eps <= {EPS_MAX:g} (e.g. {example}): eps only guards a "
          "division; a large eps scales every gradient toward 0 or stops clipping altogether")


def growing_lambda_rel(field: str, value: float) -> None:
    """AdaGC's ``lambda_rel`` > 1: at or below 1 the running norm ``gamma`` can only shrink (it follows
    ``min(||g||, lambda_rel * gamma)``), so every gradient is scaled toward 0 as training goes on."""
    positive(field, value, "1.04")
    check(value > 1.0, field, value, "use a value above 1 (e.g. 1.04, the paper's): at or below 1 AdaGC's "
          "running norm can only shrink, so every gradient is scaled toward 0 over time")
NONFINITE = ("skip", "zero", "raise")
SKIP_STEP = ("auto", "fused", "sync", "restore", "off")


#: option name -> its schema, in the order the schemas are defined (each registers itself: ``ClipConfig``)
CLIP_SCHEMAS: dict[str, type["ClipConfig"]] = {}


@dataclass
class ClipConfig:
    """What every clip option has: its ``kind`` (fixed by the schema) and the non-finite policy.

    Class-level facts of an option (not config fields): ``KIND``, its name; ``ONE_THRESHOLD``, one
    threshold for the whole gradient (logged as ``clip/threshold/global`` only) rather than one per
    tensor or layer; ``LOOSEN``, what to change when its clipping has become a learning-rate cut."""

    KIND: ClassVar[str] = "none"
    ONE_THRESHOLD: ClassVar[bool] = True
    LOOSEN: ClassVar[str] = "loosen the clipper's threshold"

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if "KIND" in cls.__dict__:  # an option of its own (a subclass without KIND refines one)
            CLIP_SCHEMAS[cls.KIND] = cls

    kind: str = "none"
    on_nonfinite: str = "skip"  # skip | zero | raise
    # how a skip is made exact where the optimizer is known (watch(), callbacks, GradMonitor(optimizer=)):
    # auto (fused found_inf when the optimizer is fused, else sync) | fused | sync | restore | off (zero only)
    skip_step: str = "auto"

    def __post_init__(self) -> None:
        check_types(self, "clip")
        one_of("clip.kind", self.kind, CLIP_SCHEMAS)
        check(self.kind == self.KIND, "clip.kind", self.kind,
              f"{type(self).__name__} is the schema of clip={self.KIND}; choose the clipper itself: "
              f"clip={self.kind} (Hydra), clip={{'kind': {self.kind!r}, ...}} (watch) or "
              f"{CLIP_SCHEMAS[self.kind].__name__}(...)")
        one_of("clip.on_nonfinite", self.on_nonfinite, NONFINITE)
        one_of("clip.skip_step", self.skip_step, SKIP_STEP)
        self._check_fields()

    def _check_fields(self) -> None:
        """The option's own range checks (type checks already ran)."""


@dataclass
class NoClipConfig(ClipConfig):
    """``clip=none``: norms are measured, nothing is scaled (non-finite gradients still handled)."""

    KIND: ClassVar[str] = "none"


@dataclass
class GlobalClipConfig(ClipConfig):
    """``clip=global``: ``clip_grad_norm_`` at ``max_norm``."""

    KIND: ClassVar[str] = "global"
    LOOSEN: ClassVar[str] = "raise clip.max_norm above the norms of healthy steps"

    kind: str = "global"
    max_norm: float = 1.0

    def _check_fields(self) -> None:
        positive("clip.max_norm", self.max_norm, "1.0")


@dataclass
class AdaGCConfig(ClipConfig):
    """``clip=adagc``: the defaults of the official PyTorch patch."""

    KIND: ClassVar[str] = "adagc"
    ONE_THRESHOLD: ClassVar[bool] = False  # per tensor (mode=global: one; the clipper says which)
    LOOSEN: ClassVar[str] = (
        "raise clip.lambda_rel and lower clip.beta together: AdaGC's threshold grows by at most "
        "(lambda_rel - 1) * (1 - beta) a step, 0.04% at the defaults (1.04, 0.99); the spike demo "
        "uses clip.mode=global lambda_rel=1.5 beta=0.95 (clips 2.5% of its steps). Or use clip=zclip")

    kind: str = "adagc"
    lambda_rel: float = 1.04
    beta: float = 0.99
    warmup_steps: int = 100  # 0 = no warm-up (the official code accepts it)
    lambda_abs: float = 1.0
    eps: float = 1e-6
    mode: str = "tensor"  # tensor (AdaGC) | shard (AdaGC-Shard) | global (AdaGC-Global)

    def _check_fields(self) -> None:
        growing_lambda_rel("clip.lambda_rel", self.lambda_rel)
        in_unit_interval("clip.beta", self.beta, "0.99")
        integer("clip.warmup_steps", self.warmup_steps, 0, "100 (0 = no warm-up)")
        positive("clip.lambda_abs", self.lambda_abs, "1.0")
        small_eps("clip.eps", self.eps, "1e-6; the official AdaGC code rejects 0", allow_zero=False)
        one_of("clip.mode", self.mode, ("tensor", "shard", "global"))


@dataclass
class ZClipConfig(ClipConfig):
    """``clip=zclip``: the published defaults, without the package's hidden fixed cap."""

    KIND: ClassVar[str] = "zclip"
    LOOSEN: ClassVar[str] = "raise clip.z_thresh or clip.clip_factor"

    kind: str = "zclip"
    alpha: float = 0.97
    z_thresh: float = 2.5
    warmup_steps: int = 25
    mode: str = "zscore"  # zscore | percentile
    clip_option: str = "adaptive_scaling"  # adaptive_scaling | mean
    eps: float = 1e-6
    clip_factor: float = 1.0  # multiplies the adaptive_scaling threshold
    # a fixed cap on top of ZClip, also in warm-up. null = none; the zclip package defaults to 1.0
    max_grad_norm: Optional[float] = None
    skip_update_on_spike: bool = False  # a clipped step does not update ZClip's EMA

    def _check_fields(self) -> None:
        in_unit_interval("clip.alpha", self.alpha, "0.97")
        positive("clip.z_thresh", self.z_thresh, "2.5")
        integer("clip.warmup_steps", self.warmup_steps, 1, "25")
        one_of("clip.mode", self.mode, ("zscore", "percentile"))
        one_of("clip.clip_option", self.clip_option, ("adaptive_scaling", "mean"))
        small_eps("clip.eps", self.eps, "1e-6", allow_zero=True)
        positive("clip.clip_factor", self.clip_factor, "1.0")
        if self.max_grad_norm is not None:
            positive("clip.max_grad_norm", self.max_grad_norm, "1.0, or null for no fixed cap")


@dataclass
class LayerClipConfig(ClipConfig):
    """``clip=layerclip``: ZClip's z-score rule per layer."""

    KIND: ClassVar[str] = "layerclip"
    ONE_THRESHOLD: ClassVar[bool] = False  # per layer
    LOOSEN: ClassVar[str] = "raise clip.z_thresh"

    kind: str = "layerclip"
    z_thresh: float = 3.0
    alpha: float = 0.97
    warmup_steps: int = 25
    eps: float = 1e-6

    def _check_fields(self) -> None:
        positive("clip.z_thresh", self.z_thresh, "3.0")
        in_unit_interval("clip.alpha", self.alpha, "0.97")
        integer("clip.warmup_steps", self.warmup_steps, 1, "25")
        small_eps("clip.eps", self.eps, "1e-6", allow_zero=True)


def clip_schema(kind: str) -> type[ClipConfig]:
    """The schema of option ``clip=<kind>``; ``ConfigError`` naming ``clip.kind`` otherwise."""
    one_of("clip.kind", kind, CLIP_SCHEMAS)
    return CLIP_SCHEMAS[kind]
