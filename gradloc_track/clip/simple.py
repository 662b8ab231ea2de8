"""Global-norm clipping (same result as ``torch.nn.utils.clip_grad_norm_``) and no clipping."""
from __future__ import annotations

from typing import Any

import torch

from ..config._validate import finite, positive
from .clipper import Clipper


class GlobalClip(Clipper):
    """``g <- g * min(1, max_norm / (||g|| + 1e-6))``, exactly as ``clip_grad_norm_``."""

    kind = "global"
    single_coef = True  # one coefficient: a fused optimizer applies it (clip.handoff)

    def __init__(self, model: torch.nn.Module, max_norm: float = 1.0, on_nonfinite: str = "skip",
                 process_group: Any = None, skip_step: str = "auto") -> None:
        positive("max_norm", max_norm, "1.0")
        finite("max_norm", max_norm)
        super().__init__(model, on_nonfinite, process_group, skip_step)
        self.max_norm = max_norm

    def _coefs(self, norms, finite):
        total = norms.pow(2).sum().sqrt()  # fp32 whatever the gradients' dtypes
        coef = (self.max_norm / (total + 1e-6)).clamp(max=1.0)  # () fp32, applied per dtype
        return torch.full_like(norms, self.max_norm), coef


class NoClip(Clipper):
    """Measures, never scales (non-finite gradients are still handled per ``on_nonfinite``): with a
    ``SkipStepGuard`` it makes no pass over the gradients at all."""

    kind = "none"
    scales = False
