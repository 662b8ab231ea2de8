"""What the clipper did (or will do) to ``.grad`` this step, in the shape each reader needs: the
optimizer's update signal (``DetectorInputs``) and the localizer's step check (``LocateStep.grad_scale``)."""
from __future__ import annotations

from typing import Any

import torch

from .adam_update import NO_CLIP, ClipScale
from .param_set import ParamSet


def optimizer_scale(param_set: ParamSet, clipper: Any, clip: Any, clips_after_verdict: bool) -> ClipScale | None:
    """What the clipper does to the gradient before the optimizer's step, for the update signal: nothing
    without a clipper, else its per-tensor coefficients (applied to ``.grad`` now, or by a fused optimizer's
    ``grad_scale``); None when this step does not know it (``clips_after_verdict``: surgery clips after the
    detector's verdict; a clipper over other tensors than the monitored)."""
    if clips_after_verdict:
        return None
    if clip is None:
        return NO_CLIP if clipper is None else None
    return ClipScale(clip.coef_t, not clip.deferred) if param_set.clip_index is None else None


def localizer_scale(param_set: ParamSet, clipper: Any, clip: Any) -> torch.Tensor | float | None:
    """What the clipper did to ``.grad`` before the localizer runs: its per-tensor coefficients
    (``ClipResult.coef_t``, a device tensor) in the monitored tensors' order, which is the
    localizer's (``trainable_params(model)``); 1 for tensors the clipper does not hold; 1 with no
    clipper (nothing of ours rescaled ``.grad``: the check allows one factor, a user's global clip,
    not one per tensor). None when nothing clipped yet (``spikes.response=surgery`` clips after the
    verdict; a clip handed to a fused optimizer's ``grad_scale``, which applies it inside ``step()``)."""
    if clip is None and clipper is None:
        return 1.0
    if clip is None or clip.deferred:
        return None
    if param_set.clip_index is None:  # the clipper holds the monitored tensors, in their order
        return clip.coef_t
    pos = {n: i for i, n in enumerate(clip.names)}
    pairs = [(i, pos[n]) for i, n in enumerate(param_set.names) if n in pos]
    out = torch.ones(len(param_set.names), dtype=clip.coef_t.dtype, device=clip.coef_t.device)
    if pairs:  # host->device index copies: on a spike step only
        ours, theirs = (torch.tensor(x, device=out.device) for x in zip(*pairs))
        out[ours] = clip.coef_t[theirs]
    return out
