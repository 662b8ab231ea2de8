"""ZClip: z-score clipping of the global gradient norm (arXiv 2504.02507).

Same semantics as the ``zclip`` package run with ``max_grad_norm=None`` (no hidden fixed clip):
warm-up collects ``warmup_steps`` norms without clipping, then mean/population variance
initialise the EMA. Afterwards ``z = (g - mu) / (sigma + eps)``; ``zscore`` mode clips when
``z > z_thresh`` to ``mu + z_thresh * sigma / (z / z_thresh)`` (``adaptive_scaling``) or ``mu``
(``mean``); ``percentile`` mode clips to ``mu + z_thresh * sigma`` whenever above it. The EMA is
updated with the threshold on a clipped step, else with ``g``. Unlike the package, state lives on
the device (no host sync) and the threshold is returned so it can be logged.
"""
from __future__ import annotations

from typing import Any

import torch

from ..config._validate import check, one_of
from .base import Clipper, in_unit_interval, positive
from .running_stats import WarmupEma


class ZClip(Clipper):
    kind = "zclip"

    def __init__(self, model: torch.nn.Module, alpha: float = 0.97, z_thresh: float = 2.5,
                 warmup_steps: int = 25, mode: str = "zscore", clip_option: str = "adaptive_scaling",
                 eps: float = 1e-6, clip_factor: float = 1.0, on_nonfinite: str = "skip",
                 process_group: Any = None) -> None:
        in_unit_interval("alpha", alpha)
        positive("z_thresh", z_thresh, "2.5")
        check(warmup_steps >= 1, "warmup_steps", warmup_steps, "use 1 or more steps")
        one_of("mode", mode, ("zscore", "percentile"))
        one_of("clip_option", clip_option, ("adaptive_scaling", "mean"))
        super().__init__(model, on_nonfinite, process_group)
        self.alpha, self.z_thresh, self.warmup_steps = alpha, z_thresh, warmup_steps
        self.mode, self.clip_option, self.eps, self.clip_factor = mode, clip_option, eps, clip_factor
        device = self.params[0].device
        self.stats = WarmupEma(warmup_steps, alpha, (), device)
        self._threshold = torch.zeros((), device=device)

    @property
    def initialized(self) -> bool:
        return self.stats.ready

    @property
    def mean(self) -> torch.Tensor:
        return self.stats.mean

    @property
    def var(self) -> torch.Tensor:
        return self.stats.var

    def _threshold_for(self, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(threshold, clipped?) for total norm ``g``; threshold = g when not clipped."""
        std = self.var.sqrt()
        if self.mode == "percentile":
            thr = self.mean + self.z_thresh * std
            hit = g > thr
        else:
            z = (g - self.mean) / (std + self.eps)
            hit = z > self.z_thresh
            if self.clip_option == "adaptive_scaling":
                thr = (self.mean + self.z_thresh * std / (z / self.z_thresh)) * self.clip_factor
            else:
                thr = self.mean
        return torch.where(hit, thr, g), hit

    def _coefs(self, norms, finite):
        g = norms.pow(2).sum().sqrt()
        if not self.initialized:
            self._g = g
            return torch.full_like(norms, float("inf")), torch.ones_like(norms)
        thr, hit = self._threshold_for(g)
        self._threshold = thr
        coef = torch.where(g > thr, thr / (g + 1e-6), torch.ones_like(g))
        self._g = g
        # reported threshold: the clip target on a clipped step, else the trigger mu + z*sigma
        trigger = self.mean + self.z_thresh * self.var.sqrt()
        reported = torch.where(hit, thr, trigger)
        return reported.expand_as(norms).clone(), coef.expand_as(norms).clone()

    def _update(self, norms, thresholds, coefs, finite_t, all_finite) -> None:
        # warm-up collects g; afterwards the EMA sees the threshold on a clipped step, else g
        self.stats.add(self._threshold if self.initialized else self._g, all_finite)

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "stats": self.stats.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = int(state["steps"])
        self.stats.load_state_dict(state["stats"])
