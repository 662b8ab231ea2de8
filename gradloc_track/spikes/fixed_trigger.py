"""GradLoc's fixed trigger (``spikes.mode="fixed"``): fire when the global norm exceeds
``per_token_threshold / sqrt(n_tokens) * n_micro_batches`` (Tencent-Hunyuan/GradLoc
``patches/gradloc.patch``); unlike GradLoc it also fires on NaN/Inf."""
from __future__ import annotations

import math

from ..config._validate import ConfigError
from .event import SpikeEvent


def fixed_events(per_token_threshold: float, step: int, g: float, n_tokens: int | None, n_micro_batches: int,
                 metrics: dict[str, float]) -> list[SpikeEvent]:
    """``g > T / sqrt(max(1, n_tokens)) * n_micro_batches`` (strict); ``spike/threshold`` and ``spike/ratio``."""
    if n_tokens is None:
        raise ConfigError("spikes.mode='fixed' needs n_tokens (the number of loss tokens in the step): "
                          "pass it to update(), or give the monitor a spike_context")
    if isinstance(n_micro_batches, bool) or not isinstance(n_micro_batches, int) or n_micro_batches < 1:
        raise ConfigError(f"n_micro_batches={n_micro_batches!r} is invalid: use the number of micro-batches "
                          "accumulated into this step (1 or more)")
    thr = per_token_threshold / math.sqrt(max(1, n_tokens)) * n_micro_batches
    ratio = g / thr
    metrics["spike/threshold"], metrics["spike/ratio"] = thr, ratio
    if not math.isfinite(g) or g > thr:
        return [SpikeEvent(step, "global", g, thr, ratio, ratio)]
    return []
