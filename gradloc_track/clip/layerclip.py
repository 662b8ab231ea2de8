"""LayerClip: per-layer adaptive limits from each layer's own running statistics.

GradLoc (Tencent Hunyuan, 2026) found "layerwise gradient heterogeneity": a token can make a few
layers explode while the global norm stays unremarkable, so a global clip is too coarse. No
formula was published; ours is ZClip's z-score rule applied to every layer separately:

- each layer ``l`` (a block/module group from ``LayerGrouping``) keeps an EMA mean ``mu_l`` and
  variance ``var_l`` of its gradient norm ``n_l``, initialised from its first ``warmup_steps``
  norms (mean / population variance; no clipping during warm-up);
- ``z_l = (n_l - mu_l) / (sigma_l + eps)``; if ``z_l > z_thresh`` the layer is scaled to
  ``tau_l = mu_l + z_thresh * sigma_l / (z_l / z_thresh)`` (larger outliers clipped harder),
  else left alone (``tau_l = n_l``);
- the EMA is updated with ``tau_l`` (the clipped value), so one spike does not raise the bar.

Every tensor of a layer gets the layer's coefficient ``tau_l / n_l``, so the direction inside a
layer is kept while one exploding layer can no longer dominate the update.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from ..config._validate import check
from ..grouping import LayerGrouping
from .base import Clipper, in_unit_interval, positive


class LayerClip(Clipper):
    kind = "layerclip"

    def __init__(self, model: torch.nn.Module, z_thresh: float = 3.0, alpha: float = 0.97,
                 warmup_steps: int = 25, eps: float = 1e-6, group_by: str = "block",
                 groups: Mapping[str, str] | None = None, on_nonfinite: str = "skip",
                 process_group: Any = None) -> None:
        positive("z_thresh", z_thresh, "3.0")
        in_unit_interval("alpha", alpha)
        check(warmup_steps >= 1, "warmup_steps", warmup_steps, "use 1 or more steps")
        super().__init__(model, on_nonfinite, process_group)
        self.grouping = LayerGrouping.build(self.names, group_by, groups)
        self.z_thresh, self.alpha, self.warmup_steps, self.eps = z_thresh, alpha, warmup_steps, eps
        dev = self.params[0].device
        L = len(self.grouping.layers)
        self._index = torch.as_tensor(self.grouping.index, device=dev)  # (n,) tensor -> layer
        self.buffer = torch.zeros(warmup_steps, L, device=dev)
        self.n_buffered = 0
        self.mean = torch.zeros(L, device=dev)
        self.var = torch.zeros(L, device=dev)

    def _coefs(self, norms, finite):
        layer = self.grouping.sum_by_layer(norms.pow(2)).sqrt()  # (L,)
        self._layer = layer
        if self.n_buffered < self.warmup_steps:
            self._tau = layer
            return torch.full_like(norms, float("inf")), torch.ones_like(norms)
        std = self.var.sqrt()
        z = (layer - self.mean) / (std + self.eps)
        tau = torch.where(z > self.z_thresh, self.mean + self.z_thresh * std / (z / self.z_thresh), layer)
        self._tau = tau
        coef_l = torch.where(layer > tau, tau / (layer + 1e-6), torch.ones_like(layer))  # (L,)
        thr_l = torch.where(z > self.z_thresh, tau, torch.full_like(tau, float("inf")))
        return thr_l[self._index], coef_l[self._index]

    def _update(self, norms, thresholds, coefs, finite_t, all_finite) -> None:
        if self.n_buffered < self.warmup_steps:
            prev = self.buffer[max(0, self.n_buffered - 1)]
            self.buffer[self.n_buffered] = torch.where(all_finite, self._layer, prev)
            self.n_buffered += 1
            if self.n_buffered == self.warmup_steps:
                self.mean = self.buffer.mean(0)
                self.var = (self.buffer - self.mean).pow(2).mean(0)
            return
        x = self._tau
        mean = self.alpha * self.mean + (1 - self.alpha) * x
        var = self.alpha * self.var + (1 - self.alpha) * (x - mean).pow(2)
        self.mean = torch.where(all_finite, mean, self.mean)
        self.var = torch.where(all_finite, var, self.var)

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "n_buffered": self.n_buffered, "buffer": self.buffer.clone(),
                "mean": self.mean.clone(), "var": self.var.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps, self.n_buffered = int(state["steps"]), int(state["n_buffered"])
        dev = self.buffer.device
        self.buffer, self.mean, self.var = (state[k].to(dev).clone() for k in ("buffer", "mean", "var"))
