"""0.3's spike detector (main at eb8bd93, ``spikes/detector.py``), kept here as the zoo's "before"
anchor: log-space EMA z-scores of the global and per-layer gradient norms (a plain EMA baseline, no
trend; the defaults z 6, min ratio 1.5, ratio 20, tail correction, warm-up 20), nothing else.

Written out, not imported, so the before column stays 0.3's whatever the library becomes; replayed
on the BEFORE zoo's streams it fires exactly where 0.3's live detector did (checked when the table was
made: the same 76 clean events of the demo family, the same hits).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

EPS = 1e-12


@dataclass
class _Signal:
    n: int = 0
    mean: float = 0.0
    var: float = 0.0
    m4: float = 0.0
    prev: float = 0.0
    d2: float = 0.0

    def tail_factor(self) -> float:
        if self.var <= EPS:
            return 1.0
        return min(2.0, max(1.0, (self.m4 / (self.var * self.var) / 3.0) ** 0.25))

    def absorb(self, x: float, alpha: float, baseline_alpha: float, warmup: int, moments: bool = True) -> None:
        self.n += 1
        if self.n == 1:
            self.mean = x
        elif self.n <= warmup:
            step = x - self.prev
            self.d2 += (step * step - self.d2) / (self.n - 1)
            self.mean += (1 - baseline_alpha) * (x - self.mean)
            self.var = self.d2 / 2
            self.m4 = 3 * self.var * self.var
        else:
            d = x - self.mean
            self.mean += (1 - baseline_alpha) * d
            if moments:
                self.var = alpha * self.var + (1 - alpha) * d * d
                self.m4 = alpha * self.m4 + (1 - alpha) * d ** 4
        self.prev = x


class Detector03:
    """``update(global_norm, layer_norms) -> bool``: did 0.3's default detector fire on this step?"""

    def __init__(self, z_thresh: float = 6.0, min_ratio: float = 1.5, ratio_thresh: float = 20.0,
                 warmup: int = 20, alpha: float = 0.99, baseline_alpha: float = 0.9) -> None:
        self.z, self.min_ratio, self.ratio, self.warmup = z_thresh, min_ratio, ratio_thresh, warmup
        self.alpha, self.baseline_alpha = alpha, baseline_alpha
        self.signals: dict[str, _Signal] = {}

    def update(self, global_norm: float, layer_norms: dict[str, float]) -> bool:
        pending, fired = [], False
        for name, x in [("global", global_norm), *layer_norms.items()]:
            fired |= self._check(name, x, pending)
        for sig, lx, band in pending:
            lx = max(lx, sig.mean - band)
            if fired:
                lx = min(lx, sig.mean + band)
            sig.absorb(lx, self.alpha, self.baseline_alpha, self.warmup, moments=not fired)
        return fired

    def _check(self, name: str, x: float, pending: list) -> bool:
        sig = self.signals.setdefault(name, _Signal())
        if not math.isfinite(x):
            return True
        if x <= 0.0:
            return False
        lx = math.log(x)
        if sig.n < self.warmup:
            sig.absorb(lx, self.alpha, self.baseline_alpha, self.warmup)
            return False
        z = (lx - sig.mean) / math.sqrt(sig.var + EPS)
        ratio = math.exp(lx - sig.mean)
        z_eff = self.z * sig.tail_factor()
        pending.append((sig, lx, z_eff * math.sqrt(sig.var)))
        return (z > z_eff and ratio > self.min_ratio) or ratio > self.ratio


def fire_03(steps) -> set[int]:
    """The steps 0.3's detector fires on in a zoo stream."""
    det = Detector03()
    return {r.step for r in steps if det.update(r.global_norm, r.layers)}
