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
- the EMA is updated with ``tau_l`` (the clipped value), so one spike does not raise the bar;
- a layer without a usable gradient this step (none, all zeros, non-finite) leaves its statistics
  alone, and each layer warms up on its own first ``warmup_steps`` gradients: a branch unused for
  the first thousand steps is not judged against zeros when it wakes up.

Every tensor of a layer gets the layer's coefficient ``tau_l / n_l``, so the direction inside a
layer is kept while one exploding layer can no longer dominate the update. A tensor's reported
threshold is its share of the layer's limit, ``limit_l * n_i / n_l`` (the norm it is, or would
be, scaled to; ``limit_l`` is ``tau_l`` on a clipped step, else the trigger ``mu_l + z_thresh *
sigma_l``), so the per-layer metric ``sqrt(sum_i thr_i^2)`` is exactly ``limit_l``; infinite (no
limit) while the layer warms up.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from ..config.clip import LayerClipConfig
from ..grouping import LayerGrouping
from .clipper import Clipper
from .running_stats import WarmupEma, WarmupEmaState


class LayerClip(WarmupEmaState, Clipper):
    Schema = LayerClipConfig

    def __init__(self, model: torch.nn.Module, config: LayerClipConfig | None = None, *, group_by: str = "block",
                 groups: Mapping[str, str] | None = None, process_group: Any = None, **options: Any) -> None:
        """``config`` or its fields by name (``z_thresh``, ``alpha``, ...); ``group_by``/``groups``: what a
        layer is (``grouping.LayerGrouping``)."""
        super().__init__(model, config, process_group=process_group, **options)
        self.grouping = LayerGrouping.build(self.names, group_by, groups)
        dev = self.params[0].device
        self._index = torch.as_tensor(self.grouping.index, device=dev)  # (n,) tensor -> layer
        self.stats = WarmupEma(self.warmup_steps, self.alpha, (len(self.grouping.layers),), dev)

    def _adopt(self, index: list[int | None], names: list[str]) -> bool:
        return False  # per-layer statistics keyed by the layers it was built with: the monitor says so

    @property
    def single_coef(self) -> bool:
        """Every layer still warming up: the next clip() scales by one coefficient (1), which a fused
        optimizer applies in its own pass (``clip.handoff``); afterwards one per layer."""
        return not self.stats.maybe_ready

    def _coefs(self, norms, finite):
        layer = self.grouping.sum_by_layer(norms.pow(2)).sqrt()  # (L,)
        self._layer = layer
        if not self.stats.maybe_ready:  # host-known: every layer is still warming up, nothing clipped
            self._tau = layer
            return torch.full_like(norms, float("inf")), torch.ones((), device=norms.device)
        ready = self.stats.ready  # (L,) per layer: its own warm-up is over
        mean, std = self.stats.mean, self.stats.std
        z = (layer - mean) / (std + self.eps)
        hit = (z > self.z_thresh) & ready
        tau = torch.where(hit, mean + self.z_thresh * std / (z / self.z_thresh), layer)
        self._tau = tau
        coef_l = torch.where(layer > tau, tau / (layer + 1e-6), torch.ones_like(layer))  # (L,)
        # reported per layer: the clip target on a clipped step, else the trigger mu + z*sigma;
        # per tensor: its share of that (the norm it is, or would be, scaled to)
        limit = torch.where(hit, tau, mean + self.z_thresh * std)
        limit = torch.where(ready, limit, torch.full_like(limit, float("inf")))  # (L,)
        share = limit[self._index] * norms / layer[self._index].clamp_min(1e-30)  # (n,)
        return torch.where(norms > 0, share, torch.full_like(share, float("inf"))), coef_l[self._index]

    def _update(self, norms, thresholds, coefs, finite_t, all_finite) -> None:
        # the clipped layer norm (= the norm when not clipped) of each layer with a usable gradient:
        # finite, non-zero (a layer without gradient this step is not a sample of its norm)
        bad = self.grouping.sum_by_layer((~finite_t).float()) > 0  # (L,)
        self.stats.add(self._tau, ~bad & (self._layer > 0))
