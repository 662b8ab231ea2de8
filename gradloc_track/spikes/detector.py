"""The spike detector: adaptive EMA z-scores on the global norm and on every layer's norm.

Norms fluctuate multiplicatively (a layer at 0.3 wobbling to 0.6 is like one at 3 wobbling to
6), so statistics live in log space: per signal (``global`` and each layer) an EMA mean ``m`` and
variance ``v`` of ``log x``; ``z = (log x - m) / sqrt(v + eps)``; the reported baseline is
``exp(m)`` (a geometric running mean) and ``ratio = x / baseline``. A signal fires when, after its warm-up,
``(z > z_thresh and ratio > min_ratio) or ratio > ratio_thresh`` — the ``min_ratio`` guard keeps
a very steady signal from firing on a tiny absolute wobble; the ratio rule catches a layer that
jumps several-fold even while its history is noisy. Per-layer signals are what catch a single
layer exploding while the global norm stays calm (GradLoc's "layerwise heterogeneity").

A firing value is absorbed *clipped* to ``exp(m + z_thresh * sqrt(v))``, so one spike does not raise
the baseline but a genuine level shift is still followed. Non-finite values always fire and are
never absorbed. ``mode="fixed"`` is GradLoc's knob: fire when the global norm exceeds
``per_token_threshold / sqrt(n_tokens)``.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, fields
from typing import Any, Mapping

from ..config import SpikeConfig
from ..config._validate import ConfigError
from .event import SpikeEvent
from .score import is_spike

EPS = 1e-12


@dataclass
class _Signal:
    n: int = 0
    mean: float = 0.0
    var: float = 0.0

    def z_ratio(self, lx: float) -> tuple[float, float]:
        """z-score and ratio to the baseline of a log-value ``lx``."""
        return (lx - self.mean) / math.sqrt(self.var + EPS), math.exp(lx - self.mean)

    @property
    def baseline(self) -> float:
        return math.exp(self.mean)

    def absorb(self, x: float, alpha: float, warmup: int) -> None:
        self.n += 1
        if self.n <= max(1, warmup):  # warm-up: exact running mean / population variance
            d = x - self.mean
            self.mean += d / self.n
            self.var += (d * (x - self.mean) - self.var) / self.n
        else:
            d = x - self.mean
            self.mean += (1 - alpha) * d
            self.var = alpha * (self.var + (1 - alpha) * d * d)


class SpikeDetector:
    """``update(step, global_norm, layer_norms) -> list[SpikeEvent]``; ``metrics()`` for logging."""

    min_ratio = 1.5

    def __init__(self, config: SpikeConfig | None = None, **overrides: Any) -> None:
        if config is None:
            known = {f.name for f in fields(SpikeConfig)}
            unknown = set(overrides) - known
            if unknown:
                raise TypeError(f"SpikeDetector got unknown option(s) {sorted(unknown)}; valid: {sorted(known)}")
            config = SpikeConfig(**overrides)
        elif overrides:
            raise TypeError("pass either config=SpikeConfig(...) or option keywords, not both")
        self.config = config
        self.signals: dict[str, _Signal] = {}
        self.count = 0
        self._history: deque[float] = deque(maxlen=config.score_window)
        self._score_hits = 0
        self._score_seen = 0
        self._last: dict[str, float] = {}
        self._z: dict[str, float] = {}  # latest z per signal

    def update(self, step: int, global_norm: float, layer_norms: Mapping[str, float] | None = None,
               n_tokens: int | None = None) -> list[SpikeEvent]:
        cfg = self.config
        self._score(global_norm)
        if cfg.mode == "fixed":
            events = self._fixed(step, global_norm, n_tokens)
        else:
            events = []
            ev = self._check("global", step, global_norm)
            if ev:
                events.append(ev)
            if cfg.per_layer and layer_norms:
                zmax = -math.inf
                layer_events = []
                for name, x in layer_norms.items():
                    ev = self._check(name, step, x)
                    zmax = max(zmax, self._z.get(name, -math.inf))
                    if ev:
                        layer_events.append(ev)
                events += sorted(layer_events, key=lambda e: -e.z)
                self._last["spike/z_max_layer"] = zmax if math.isfinite(zmax) else 0.0
        self.count += len(events) > 0
        self._last["spike/fired"] = float(len(events) > 0)
        self._last["spike/count"] = float(self.count)
        return events

    def metrics(self) -> dict[str, float]:
        out = dict(self._last)
        out["spike/score"] = self._score_hits / self._score_seen if self._score_seen else 0.0
        return out

    # -- internals ---------------------------------------------------------------------
    def _check(self, name: str, step: int, x: float) -> SpikeEvent | None:
        cfg = self.config
        sig = self.signals.setdefault(name, _Signal())
        if not math.isfinite(x):
            self._z[name] = math.inf
            return SpikeEvent(step, name, x, sig.baseline if sig.n else 0.0, math.inf, math.inf)
        fired = None
        lx = math.log(max(x, 1e-30))
        if sig.n >= max(1, cfg.warmup_steps):
            z, ratio = sig.z_ratio(lx)
            self._z[name] = z
            if name == "global":
                self._last["spike/z/global"], self._last["spike/ratio/global"] = z, ratio
            if (z > cfg.z_thresh and ratio > self.min_ratio) or ratio > cfg.ratio_thresh:
                fired = SpikeEvent(step, name, x, sig.baseline, z, ratio)
                lx = min(lx, sig.mean + cfg.z_thresh * math.sqrt(sig.var))  # absorb clipped
        sig.absorb(lx, cfg.alpha, cfg.warmup_steps)
        return fired

    def _fixed(self, step: int, g: float, n_tokens: int | None) -> list[SpikeEvent]:
        if not n_tokens or n_tokens <= 0:
            raise ConfigError("spikes.mode='fixed' needs n_tokens (the number of loss tokens in the batch): "
                              "pass it to update(), or give the monitor a spike_context")
        thr = self.config.per_token_threshold / math.sqrt(n_tokens)
        ratio = g / thr
        self._last["spike/ratio/global"] = ratio
        if not math.isfinite(g) or g > thr:
            return [SpikeEvent(step, "global", g, thr, ratio, ratio)]
        return []

    def _score(self, g: float) -> None:
        if len(self._history) >= min(16, self.config.score_window):
            self._score_seen += 1
            self._score_hits += (not math.isfinite(g)) or is_spike(self._history, g)
        if math.isfinite(g):
            self._history.append(g)

    def state_dict(self) -> dict[str, Any]:
        return {"signals": {k: (s.n, s.mean, s.var) for k, s in self.signals.items()}, "count": self.count,
                "history": list(self._history), "score": (self._score_hits, self._score_seen)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.signals = {k: _Signal(*v) for k, v in state["signals"].items()}
        self.count = int(state["count"])
        self._history = deque(state["history"], maxlen=self.config.score_window)
        self._score_hits, self._score_seen = state["score"]
