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


class RunningWindow:
    """The last ``window`` values with their running sum and sum of squares: ``is_spike`` in O(1)
    per step instead of two passes over the window (the detector asks every step). The sums are
    recomputed exactly every ``window`` values, so rounding never accumulates."""

    def __init__(self, window: int, values: Iterable[float] = ()) -> None:
        self.values: deque[float] = deque(maxlen=window)
        self._sum = self._sq = 0.0
        self._since_exact = 0
        for v in values:
            self.append(v)

    def __len__(self) -> int:
        return len(self.values)

    def __iter__(self):
        return iter(self.values)

    def append(self, v: float) -> None:
        if len(self.values) == self.values.maxlen:
            old = self.values[0]
            self._sum -= old
            self._sq -= old * old
        self.values.append(v)
        self._sum += v
        self._sq += v * v
        self._since_exact += 1
        if self._since_exact >= self.values.maxlen:
            self._sum, self._sq = math.fsum(self.values), math.fsum(x * x for x in self.values)
            self._since_exact = 0

    def is_spike(self, value: float, n_sigma: float = 6.0) -> bool:
        """``is_spike(self.values, value, n_sigma)``, from the running sums."""
        n = len(self.values)
        if n < 2:
            return False
        mean = self._sum / n
        std = math.sqrt(max(0.0, self._sq / n - mean * mean))
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
