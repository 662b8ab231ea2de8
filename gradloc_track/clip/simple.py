"""Global-norm clipping (same result as ``torch.nn.utils.clip_grad_norm_``) and no clipping."""
from __future__ import annotations

from typing import Any

import torch

from ..config.clip import GlobalClipConfig, NoClipConfig
from .clipper import Clipper


class GlobalClip(Clipper):
    """``g <- g * min(1, max_norm / (||g|| + 1e-6))``, exactly as ``clip_grad_norm_``.
    ``GlobalClip(model, 1.0)``: ``max_norm`` may come first, as in ``clip_grad_norm_``."""

    Schema = GlobalClipConfig
    single_coef = True  # one coefficient: a fused optimizer applies it (clip.handoff)

    def __init__(self, model: torch.nn.Module, max_norm: float | GlobalClipConfig | None = None, *,
                 process_group: Any = None, **options: Any) -> None:
        config = max_norm if isinstance(max_norm, GlobalClipConfig) else None
        if max_norm is not None and config is None:
            options["max_norm"] = max_norm
        super().__init__(model, config, process_group=process_group, **options)

    def _coefs(self, norms, finite):
        total = norms.pow(2).sum().sqrt()  # fp32 whatever the gradients' dtypes
        coef = (self.max_norm / (total + 1e-6)).clamp(max=1.0)  # () fp32, applied per dtype
        return torch.full_like(norms, self.max_norm), coef


class NoClip(Clipper):
    """Measures, never scales (non-finite gradients are still handled per ``on_nonfinite``): with a
    ``SkipStepGuard`` it makes no pass over the gradients at all."""

    Schema = NoClipConfig
    scales = False
