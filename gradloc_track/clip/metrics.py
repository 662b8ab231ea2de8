"""Clip metrics for the monitor, as 0-d device tensors (stacked with the rest, one transfer).

- ``clip/threshold/global``: the global threshold in force. Global clippers (GlobalClip, ZClip,
  AdaGC ``mode="global"``): theirs; per-tensor/per-layer clippers (AdaGC, LayerClip):
  ``sqrt(sum_i tau_i^2)`` over the tensors that have a threshold, the global norm if every tensor
  sat at its threshold; during AdaGC's warm-up, the global clip in force, ``lambda_abs``.
- ``clip/threshold/<layer>`` (per-tensor/per-layer clippers): ``sqrt(sum_i tau_i^2)`` over the
  layer's tensors that have one, ``tau_i`` being the norm the tensor is (or would be) scaled to.
  During AdaGC's warm-up, the layer's share of the global clip, ``lambda_abs * ||g_l|| / ||g||``:
  the values sit on the scale of the layer's own norm, warm-up and after alike (0.2 logged
  ``sqrt(#tensors) * lambda_abs`` in warm-up, which set the chart's y-axis and flattened the real
  thresholds to a line at 0).
- No threshold in force (a warm-up without clipping, a layer never seen): NaN, which the monitor
  leaves out of what it logs (no point on the chart, rather than a sentinel that skews it).
- ``clip/coef/<layer>``: ``||g_layer after|| / ||g_layer before||`` (1 = untouched; 0 = a non-finite step
  skipped, or the layer's non-finite gradient zeroed).
- ``clip/clipped_fraction``: fraction of tensors whose coefficient is below 1 this step.
- ``clip/saturation/clipped_fraction``, ``clip/saturation/mean_coef``: share of recent steps
  (after warm-up) that were scaled and their mean coefficient (``gradloc_track.clip.saturation``).
- ``clip/total_norm_pre``, ``clip/total_norm_post``: global norm before / after.
- ``clip/nonfinite``: 1 when a non-finite gradient was seen (and handled) this step.
"""
from __future__ import annotations

import math

import torch

from ..grouping import LayerGrouping
from .clipper import ClipResult
from .saturation import KEYS as SATURATION_KEYS

THRESHOLD_PREFIX = "clip/threshold/"


def _root_sum_sq(thr: torch.Tensor, grouping: LayerGrouping | None) -> torch.Tensor:
    """sqrt of the sum of squares of the finite thresholds (per layer, or over all); NaN where none."""
    finite = torch.isfinite(thr)
    sq = torch.where(finite, thr * thr, 0.0)
    count = finite.float()
    if grouping is not None:
        sq, count = grouping.sum_by_layer(sq), grouping.sum_by_layer(count)
    else:
        sq, count = sq.sum(), count.sum()
    return torch.where(count > 0, sq.sqrt(), math.nan)


def clip_metrics(result: ClipResult, grouping: LayerGrouping) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    pre_sq = torch.where(torch.isfinite(result.pre_sq_t), result.pre_sq_t, torch.zeros_like(result.pre_sq_t))
    post_sq = pre_sq * result.coef_t.pow(2)
    pre_l = grouping.sum_by_layer(pre_sq)
    post_l = grouping.sum_by_layer(post_sq)
    # a layer without a finite norm to compare (no gradient, or only non-finite ones): its tensors' mean
    # coefficient, 0 where a non-finite step was skipped or zeroed (it read 1, "untouched", beside a post norm of 0)
    mean_coef = grouping.sum_by_layer(result.coef_t.float()) / grouping.sum_by_layer(torch.ones_like(pre_sq))
    coef_l = torch.where(pre_l > 0, (post_l / pre_l.clamp_min(1e-30)).sqrt(), mean_coef)
    if result.one_threshold:  # GlobalClip, ZClip, NoClip, AdaGC mode=global (the schema's ONE_THRESHOLD)
        thr = result.threshold_t[0]
        out[THRESHOLD_PREFIX + "global"] = torch.where(torch.isfinite(thr), thr, math.nan)
    elif result.global_threshold_t is not None:  # a global clip in force (AdaGC's warm-up)
        g = result.global_threshold_t
        out[THRESHOLD_PREFIX + "global"] = g
        # each layer's share: the norm it is (or would be) scaled to, g * ||g_layer|| / ||g||
        share = pre_l.sqrt() * (g / pre_sq.sum().sqrt().clamp_min(1e-30))
        for lay, v in zip(grouping.layers, torch.where(pre_l > 0, share, math.nan).unbind()):
            out[THRESHOLD_PREFIX + lay] = v
    else:
        out[THRESHOLD_PREFIX + "global"] = _root_sum_sq(result.threshold_t, None)
        for lay, v in zip(grouping.layers, _root_sum_sq(result.threshold_t, grouping).unbind()):
            out[THRESHOLD_PREFIX + lay] = v
    for lay, v in zip(grouping.layers, coef_l.unbind()):
        out[f"clip/coef/{lay}"] = v
    out["clip/clipped_fraction"] = (result.coef_t < 1.0).float().mean()
    if result.saturation_t is not None:
        for key, v in zip(SATURATION_KEYS, result.saturation_t.unbind()):
            out[key] = v
    out["clip/total_norm_pre"] = result.total_norm_pre_t
    out["clip/total_norm_post"] = result.total_norm_post_t
    out["clip/nonfinite"] = result.nonfinite_t.float()
    return out

