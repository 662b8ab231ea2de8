"""Per-layer clip metrics for the monitor, as 0-d device tensors (stacked with the rest).

- ``clip/threshold/<layer>``: ``sqrt(sum_i tau_i^2)`` over the layer's tensors — the layer norm
  if every tensor sat exactly at its threshold (per-tensor clippers: AdaGC; per-layer: LayerClip;
  global clippers (GlobalClip, ZClip, AdaGC mode="global") log the global threshold once as
  ``clip/threshold/global`` instead). LayerClip reports per-tensor shares of its layer threshold,
  so with the same grouping this is the applied layer threshold.
  Infinite (no limit yet: warm-up / not clipped) thresholds are logged as -1.
- ``clip/coef/<layer>``: ``||g_layer after|| / ||g_layer before||`` (1 = untouched).
- ``clip/clipped_fraction``: fraction of tensors whose coefficient is below 1.
- ``clip/total_norm_pre``, ``clip/total_norm_post``: global norm before / after.
- ``clip/nonfinite``: 1 when a non-finite gradient was seen (and handled) this step.
"""
from __future__ import annotations

import torch

from ..grouping import LayerGrouping
from .base import ClipResult

GLOBAL_KINDS = ("global", "zclip", "none", "adagc_global")


def clip_metrics(result: ClipResult, grouping: LayerGrouping) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    pre_sq = torch.where(torch.isfinite(result.pre_sq_t), result.pre_sq_t, torch.zeros_like(result.pre_sq_t))
    post_sq = pre_sq * result.coef_t.pow(2)
    pre_l = grouping.sum_by_layer(pre_sq)
    post_l = grouping.sum_by_layer(post_sq)
    coef_l = torch.where(pre_l > 0, (post_l / pre_l.clamp_min(1e-30)).sqrt(), torch.ones_like(pre_l))
    if result.kind in GLOBAL_KINDS:
        thr = result.threshold_t[0]
        out["clip/threshold/global"] = torch.where(torch.isfinite(thr), thr, torch.full_like(thr, -1.0))
    else:
        finite = torch.isfinite(result.threshold_t)
        thr_sq = torch.where(finite, result.threshold_t.pow(2), torch.zeros_like(result.threshold_t))
        any_inf = grouping.sum_by_layer((~finite).float()) > 0
        thr_l = grouping.sum_by_layer(thr_sq).sqrt()
        thr_l = torch.where(any_inf, torch.full_like(thr_l, -1.0), thr_l)
        for lay, v in zip(grouping.layers, thr_l.unbind()):
            out[f"clip/threshold/{lay}"] = v
    for lay, v in zip(grouping.layers, coef_l.unbind()):
        out[f"clip/coef/{lay}"] = v
    out["clip/clipped_fraction"] = (result.coef_t < 1.0).float().mean()
    out["clip/total_norm_pre"] = result.total_norm_pre_t
    out["clip/total_norm_post"] = result.total_norm_post_t
    out["clip/nonfinite"] = result.nonfinite_t.float()
    return out
