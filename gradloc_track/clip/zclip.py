"""ZClip: z-score clipping of the global gradient norm (arXiv 2504.02507).

Same semantics as the ``zclip`` package (``bluorion-com/ZClip``): warm-up collects
``warmup_steps`` norms, then mean/population variance initialise the EMA. Afterwards
``z = (g - mu) / (sigma + eps)``; ``zscore`` mode clips when ``z > z_thresh`` to
``clip_factor * (mu + z_thresh * sigma / (z / z_thresh))`` (``adaptive_scaling``) or ``mu``
(``mean``); ``percentile`` mode clips to ``mu + z_thresh * sigma`` whenever above it. The EMA is
updated with that threshold on a clipped step (or not at all with ``skip_update_on_spike=True``),
else with ``g``.

``max_grad_norm``: an extra fixed cap ``min(threshold, max_grad_norm)``, active in warm-up too
(plain global clipping there); it never enters the EMA. Our default is ``None`` (no fixed cap):
the package's default is ``max_grad_norm=1.0``, which silently adds global clipping at 1.0 —
pass ``max_grad_norm=1.0`` to reproduce the package exactly.

Unlike the package, state lives on the device (no host sync) and the threshold is returned so
it can be logged. Degenerate steps (a non-finite or zero global norm: a NaN, an all-masked
batch) never enter the statistics; the package would count a zero norm (its warm-up would end one
step earlier and its mean/variance would carry the 0). On every other stream the two are equal.
"""
from __future__ import annotations

from typing import Any

import torch

from ..config.clip import ZClipConfig
from .clipper import Clipper
from .running_stats import WarmupEma, WarmupEmaState


class ZClip(WarmupEmaState, Clipper):
    """``ZClip(model, alpha=0.97, z_thresh=2.5, ...)``: the fields of ``ZClipConfig`` by name, or
    ``ZClip(model, ZClipConfig(...))``; ``process_group`` for the norms' all-reduce."""

    Schema = ZClipConfig
    single_coef = True  # it scales the global norm: one coefficient, which a fused optimizer applies

    def __init__(self, model: torch.nn.Module, config: ZClipConfig | None = None, *, process_group: Any = None,
                 **options: Any) -> None:
        super().__init__(model, config, process_group=process_group, **options)
        device = self.params[0].device
        self.stats = WarmupEma(self.warmup_steps, self.alpha, (), device)
        self._threshold = torch.zeros((), device=device)

    @property
    def initialized(self) -> bool:
        """The warm-up is over (reads a device value: a host sync; ``clip()`` never calls it)."""
        return self.stats.maybe_ready and bool(self.stats.ready)

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
        self._g = g
        cap = self.max_grad_norm
        # the package's warm-up: no clipping, or clip_grad_norm_(max_grad_norm)
        warm_thr = torch.full_like(g, float("inf")) if cap is None else torch.full_like(g, cap)
        warm_coef = torch.ones_like(g) if cap is None else (cap / (g + 1e-6)).clamp(max=1.0)
        if not self.stats.maybe_ready:  # host-known: still warming up, no device value needed
            self._hit = torch.zeros((), dtype=torch.bool, device=g.device)
            return warm_thr.expand_as(norms), warm_coef
        ready = self.stats.ready  # () device bool: the warm-up has seen enough usable norms
        thr, hit = self._threshold_for(g)
        self._threshold, self._hit = thr, hit & ready
        target = thr if cap is None else thr.clamp(max=cap)  # the cap never enters the EMA
        coef = torch.where(g > target, target / (g + 1e-6), torch.ones_like(g))
        # reported threshold: the clip target on a clipped step, else the trigger mu + z*sigma
        trigger = self.mean + self.z_thresh * self.var.sqrt()
        reported = torch.where(hit, thr, trigger)
        if cap is not None:
            reported = reported.clamp(max=cap)
        return torch.where(ready, reported, warm_thr).expand_as(norms), torch.where(ready, coef, warm_coef)

    def _update(self, norms, thresholds, coefs, finite_t, all_finite) -> None:
        # warm-up collects g; afterwards the EMA sees the threshold on a clipped step, else g. A step
        # with a non-finite or zero global norm is not a sample of the norm's distribution: it never
        # enters (the zclip package would add a zero norm; see the class docstring)
        ok = all_finite & (self._g > 0)
        if not self.stats.maybe_ready:
            self.stats.add(self._g, ok)
            return
        if self.skip_update_on_spike:
            ok = ok & ~self._hit
        self.stats.add(torch.where(self.stats.ready, self._threshold, self._g), ok)
