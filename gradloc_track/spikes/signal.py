"""One monitored quantity's running statistics, in log space.

Norms and losses fluctuate multiplicatively (a layer at 0.3 wobbling to 0.6 is like one at 3 wobbling
to 6), so a ``LogSignal`` keeps, of ``log x``, a level and a trend (Holt's linear exponential
smoothing, both with a short memory, ``baseline_alpha``, ~10 steps): the next value is forecast as
``level + trend``, so a steady rise is followed without lag (0.3's plain EMA lagged a layer whose norm
grew 6% a step by ~0.5 in log space, and fired on it twenty steps in a row); a fall is extrapolated
for the smooth signals only (the losses; see ``forecast``). The variance ``var`` and fourth moment
``m4`` of the forecast error are EMAs with a long memory (``alpha``, ~100 steps). During warm-up both
come from successive differences, blind to a slow trend: for independent noise ``E[d^2] = 2 var``
and ``E[d^4] = 2 m4 + 6 var^2`` (``d = x_t - x_{t-1}``), so ``m4 = (E[d^4] - 6 var^2) / 2``, never
below its Gaussian value ``3 var^2``. (It used to start at the Gaussian value: a heavy-tailed signal
then got its tail correction only as the EMA learned it, over ~100 steps, and in that time the spike
zoo's clean runs fired on a global norm and on Adam's update; docs/benchmarks.md.)
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

EPS = 1e-12
MAX_TAIL_FACTOR = 2.0  # z_eff never exceeds 2 * z_thresh, however wild the kurtosis estimate
MAX_LOG = 700.0  # exp() of more overflows a float: a ratio (or threshold) beyond e^700 is reported as e^700


@dataclass
class LogSignal:
    n: int = 0
    mean: float = 0.0  # the level: EMA of log x (decay baseline_alpha) along its trend
    var: float = 0.0  # EMA of the squared forecast error (decay alpha)
    m4: float = 0.0  # EMA of its fourth power (decay alpha), for the tail correction
    prev: float = 0.0  # the previous log-value
    d2: float = 0.0  # warm-up: mean squared successive difference of log x
    trend: float = 0.0  # EMA (decay baseline_alpha) of the level's change per step
    streak: int = 0  # consecutive steps this signal was above its band (a run of them is a level shift)
    d4: float = 0.0  # warm-up: mean fourth power of the successive differences of log x

    falls: bool = field(default=False, compare=False)  # extrapolate a falling trend too (smooth signals)

    @property
    def forecast(self) -> float:
        """The expected log-value of the next step: the level moved on by its trend when it rises. A
        falling trend is extrapolated only for a signal made smooth by averaging (``falls``: the losses,
        whose fall is what training does); for a heavy-tailed norm a baseline lagging above a falling
        signal errs on the quiet side, one extrapolated below it would read ordinary noise as a jump."""
        return self.mean + (self.trend if self.falls else max(self.trend, 0.0))

    def z_ratio(self, lx: float) -> tuple[float, float]:
        """z-score and ratio to the forecast of a log-value ``lx``."""
        f = self.forecast
        return (lx - f) / math.sqrt(self.var + EPS), math.exp(min(lx - f, MAX_LOG))

    def tail_factor(self) -> float:
        """``(kurtosis / 3) ** 0.25`` clamped to [1, MAX_TAIL_FACTOR]: 1 for Gaussian-or-lighter tails."""
        if self.var <= EPS:
            return 1.0
        return min(MAX_TAIL_FACTOR, max(1.0, (self.m4 / (self.var * self.var) / 3.0) ** 0.25))

    @property
    def baseline(self) -> float:
        return math.exp(self.forecast)

    def absorb(self, x: float, alpha: float, baseline_alpha: float, warmup: int, moments: bool = True) -> None:
        """Take log-value ``x`` in; ``moments=False`` (a value that fired, clipped) moves the level only:
        neither the trend nor the error moments learn from it."""
        self.n += 1
        if self.n == 1:
            self.mean = self.prev = x
            return
        f = self.forecast
        d = x - f
        level = f + (1 - baseline_alpha) * d
        if moments:
            self.trend += (1 - baseline_alpha) * (level - self.mean - self.trend)
        self.mean = level
        if self.n <= max(1, warmup):
            step = x - self.prev
            self.d2 += (step * step - self.d2) / (self.n - 1)
            self.d4 += (step ** 4 - self.d4) / (self.n - 1)
            self.var = self.d2 / 2
            self.m4 = max(3 * self.var * self.var, (self.d4 - 6 * self.var * self.var) / 2)
        elif moments:
            self.var = alpha * self.var + (1 - alpha) * d * d
            self.m4 = alpha * self.m4 + (1 - alpha) * d ** 4
        self.prev = x

    def as_tuple(self) -> tuple[float, ...]:
        return self.n, self.mean, self.var, self.m4, self.prev, self.d2, self.trend, self.streak, self.d4
