"""OLMo-style spike score: the fraction of steps whose value exceeds mean + n_sigma * std of the
previous ``window`` values (OLMo-core's stability monitor uses 6 sigma over the last 128)."""
from __future__ import annotations

import math
from collections import deque
from typing import Iterable


def is_spike(history: Iterable[float], value: float, n_sigma: float = 6.0) -> bool:
    h = list(history)
    if len(h) < 2:
        return False
    mean = sum(h) / len(h)
    std = math.sqrt(sum((x - mean) ** 2 for x in h) / len(h))
    return value > mean + n_sigma * std


def spike_score(values: Iterable[float], window: int = 128, n_sigma: float = 6.0, min_history: int = 16) -> float:
    """Fraction of steps (with at least ``min_history`` previous values) that are spikes."""
    hist: deque[float] = deque(maxlen=window)
    spikes = seen = 0
    for v in values:
        if len(hist) >= min_history:
            seen += 1
            spikes += (not math.isfinite(v)) or is_spike(hist, v, n_sigma)
        if math.isfinite(v):
            hist.append(v)
    return spikes / seen if seen else 0.0
