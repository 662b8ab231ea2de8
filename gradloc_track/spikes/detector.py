"""The spike detector: adaptive z-scores on the global norm and on every layer's norm.

Norms fluctuate multiplicatively (a layer at 0.3 wobbling to 0.6 is like one at 3 wobbling to
6), so statistics live in log space. Per signal (``global`` and each layer): a baseline ``m``,
an EMA of ``log x`` with a short memory (``baseline_alpha``, ~10 steps) so it follows the steady
fall of norms in early training; the variance ``v`` and fourth moment ``m4`` of ``log x - m``
as EMAs with a long memory (``alpha``, ~100 steps). ``z = (log x - m) / sqrt(v)``, ``ratio =
x / exp(m)``. After its warm-up a signal fires when ``z > z_eff and ratio > min_ratio``, or
``ratio > ratio_thresh`` (a 20x safety net). Per-layer signals catch a single layer exploding
while the global norm stays calm (GradLoc's "layerwise heterogeneity").

Calibration (issue 13): how noisy a norm is depends on the batch. At 4x32 tokens one rare token
can dominate the batch gradient, so log-norms are heavy-tailed (kurtosis 10-16 on the demo
model, against 3 for a Gaussian) and a threshold that is rare at 16x128 fires every few
hundred steps. ``tail_correction`` scales the threshold with the observed tails,
``z_eff = z_thresh * clamp((kurtosis / 3) ** 0.25, 1, 2)``: by the fourth-moment (Markov) bound
``P(|d| > k sigma) <= kurtosis / k**4`` this keeps the bound on the false-alarm rate where
``z_thresh`` puts it for Gaussian noise. The warm-up variance comes from successive
differences, so the early-training trend is not counted as noise. Measured on 2000 clean demo
steps (``benchmarks/detector_calibration.py``): 4x32: 40 events before (0.1: a 3x ratio rule,
one ``alpha=0.98`` for mean and variance), 1 after; 16x128: 3 before, 0 after.

On a step the detector caught (any signal fired: a spike caught on a layer is in the global norm
too), every signal moves its baseline by its value clipped to ``exp(m +- z_eff * sqrt(v))`` and
keeps the step out of its variance and fourth moment, so the spike does not raise the threshold
(0.2 let it in: in the spike demo one spike, caught on a layer while the global norm stayed just
below its own threshold, inflated the global kurtosis estimate and took ``spike/threshold`` from
2.4 to 4.6 for good), while a genuine level shift is still followed by the baseline over a few steps. A
value far below the baseline is absorbed clipped to ``exp(m - z_eff * sqrt(v))``. Non-finite values
always fire and are never absorbed; a zero norm (no gradient: an all-masked batch, ``loss * 0``, a
layer unused this step) neither fires nor enters (0.2 took ``log(1e-30)`` in: the variance
exploded, the threshold went to 1e32 and the baseline's fall made the next ~8 normal steps fire).

``mode="fixed"`` is GradLoc's trigger exactly: fire when the global norm exceeds
``per_token_threshold / sqrt(n_tokens) * n_micro_batches`` (``n_tokens``: loss tokens of the whole
step; Tencent-Hunyuan/GradLoc ``patches/gradloc.patch``); unlike GradLoc it also fires on NaN/Inf.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, fields
from typing import Any, Mapping

from ..config import SpikeConfig
from ..config._validate import ConfigError
from .event import SpikeEvent
from .score import RunningWindow

EPS = 1e-12
MAX_TAIL_FACTOR = 2.0  # z_eff never exceeds 2 * z_thresh, however wild the kurtosis estimate


@dataclass
class _Signal:
    n: int = 0
    mean: float = 0.0  # EMA of log x (decay baseline_alpha): the baseline
    var: float = 0.0  # EMA of (log x - mean)^2 (decay alpha)
    m4: float = 0.0  # EMA of (log x - mean)^4 (decay alpha), for the tail correction
    prev: float = 0.0  # the previous log-value
    d2: float = 0.0  # warm-up: mean squared successive difference of log x

    def z_ratio(self, lx: float) -> tuple[float, float]:
        """z-score and ratio to the baseline of a log-value ``lx``."""
        return (lx - self.mean) / math.sqrt(self.var + EPS), math.exp(lx - self.mean)

    def tail_factor(self) -> float:
        """``(kurtosis / 3) ** 0.25`` clamped to [1, MAX_TAIL_FACTOR]: 1 for Gaussian-or-lighter tails."""
        if self.var <= EPS:
            return 1.0
        return min(MAX_TAIL_FACTOR, max(1.0, (self.m4 / (self.var * self.var) / 3.0) ** 0.25))

    @property
    def baseline(self) -> float:
        return math.exp(self.mean)

    def absorb(self, x: float, alpha: float, baseline_alpha: float, warmup: int, moments: bool = True) -> None:
        """Take log-value ``x`` in; ``moments=False`` moves the baseline only (a value that fired)."""
        self.n += 1
        if self.n == 1:
            self.mean = x
        elif self.n <= max(1, warmup):
            # warm-up runs in early training, where norms fall steadily: the variance comes from
            # successive differences (E[(x_t - x_{t-1})^2] = 2 var for noise, blind to a slow
            # trend); the fourth moment starts at its Gaussian value, 3 var^2
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


class SpikeDetector:
    """``update(step, global_norm, layer_norms) -> list[SpikeEvent]``; ``metrics()`` for logging.

    Metric keys (``metrics()``):

    - ``spike/detected``: 1 on a step the detector fired, else 0
    - ``spike/detected_total``: steps it has fired on so far
    - ``spike/threshold``: the global norm above which this step would have fired (adaptive:
      ``baseline * exp(max(z_eff * sigma, log(min_ratio)))``; fixed: GradLoc's threshold); plot
      it with ``grad_norm/global``
    - ``spike/ratio``: global norm / its running baseline (fixed: / the threshold)
    - ``spike/zscore``: z-score of the global log-norm; ``spike/zscore_max_layer``: the largest
      layer z-score (adaptive mode, after warm-up)
    - ``spike/olmo_score``: OLMo-core's stability score, the fraction of steps so far whose global
      norm exceeded mean + 6 sigma of the previous ``score_window`` values (a separate, fixed rule
      kept for comparison with OLMo runs; it is not what fires the detector)
    """

    def __init__(self, config: SpikeConfig | None = None, **overrides: Any) -> None:
        if config is None:
            known = {f.name for f in fields(SpikeConfig)}
            unknown = set(overrides) - known
            if unknown:
                raise TypeError(f"SpikeDetector got unknown option(s) {sorted(unknown)}; valid: {sorted(known)}")
            config = SpikeConfig(**overrides)
        elif overrides:
            raise TypeError("pass either config=SpikeConfig(...) or option keywords, not both")
        if not isinstance(config, SpikeConfig):
            raise TypeError(f"SpikeDetector: config must be a gradloc_track.config.SpikeConfig, "
                            f"got {type(config).__name__}")
        self.config = config
        self.signals: dict[str, _Signal] = {}
        self.count = 0
        self._history = RunningWindow(config.score_window)
        self._score_hits = 0
        self._score_seen = 0
        self._last: dict[str, float] = {}
        self._z: dict[str, float] = {}  # latest z per signal
        self._last_step: int | None = None

    @property
    def needs_token_count(self) -> bool:
        """GradLoc's fixed trigger (``mode="fixed"``) divides by the step's loss-token count."""
        return self.config.mode == "fixed"

    def update(self, step: int, global_norm: float, layer_norms: Mapping[str, float] | None = None,
               n_tokens: int | None = None, n_micro_batches: int = 1) -> list[SpikeEvent]:
        """Feed one step's norms. ``n_tokens`` (loss tokens of the whole step) and
        ``n_micro_batches`` are read by ``mode="fixed"`` only. A repeated step changes nothing."""
        cfg = self.config
        if self._last_step is not None and step == self._last_step:
            warnings.warn(f"gradloc-track: SpikeDetector.update called twice for step {step}; the repeat is "
                          "ignored (its statistics advance once per step)", stacklevel=2)
            return []
        self._last_step = step
        self._score(global_norm)
        if cfg.mode == "fixed":
            events = self._fixed(step, global_norm, n_tokens, n_micro_batches)
        else:
            events = self._adaptive(step, global_norm, layer_norms)
        self.count += len(events) > 0
        self._last["spike/detected"] = float(len(events) > 0)
        self._last["spike/detected_total"] = float(self.count)
        return events

    def metrics(self) -> dict[str, float]:
        out = dict(self._last)
        out["spike/olmo_score"] = self._score_hits / self._score_seen if self._score_seen else 0.0
        return out

    # -- internals ---------------------------------------------------------------------
    def _adaptive(self, step: int, global_norm: float, layer_norms: Mapping[str, float] | None) -> list[SpikeEvent]:
        """Check every signal first, absorb afterwards: whether the step fired decides how."""
        pending: list[tuple[_Signal, float, float]] = []
        events = []
        ev = self._check("global", step, global_norm, pending)
        if ev:
            events.append(ev)
        if self.config.per_layer and layer_norms:
            zmax = -math.inf
            layer_events = []
            for name, x in layer_norms.items():
                ev = self._check(name, step, x, pending)
                zmax = max(zmax, self._z.get(name, -math.inf))
                if ev:
                    layer_events.append(ev)
            events += sorted(layer_events, key=lambda e: -e.z)
            if zmax > -math.inf:
                self._last["spike/zscore_max_layer"] = zmax if math.isfinite(zmax) else 0.0
        self._absorb(pending, fired=bool(events))
        return events

    def _absorb(self, pending: list[tuple[_Signal, float, float]], fired: bool) -> None:
        """A step the detector caught (on any signal: a layer's spike is the global norm's too) moves
        each baseline by its value clipped to the band and leaves the variance and tails alone, so
        the spike raises no threshold; other steps are absorbed whole, a value far below the
        baseline (a near-empty batch) clipped to the band."""
        cfg = self.config
        for sig, lx, band in pending:
            lx = max(lx, sig.mean - band)
            if fired:
                lx = min(lx, sig.mean + band)
            sig.absorb(lx, cfg.alpha, cfg.baseline_alpha, cfg.warmup_steps, moments=not fired)

    def _check(self, name: str, step: int, x: float, pending: list) -> SpikeEvent | None:
        """Does ``x`` fire on signal ``name``? A post-warm-up value joins ``pending`` for ``_absorb``."""
        cfg = self.config
        sig = self.signals.setdefault(name, _Signal())
        if not math.isfinite(x):  # always fires, never enters the statistics
            self._z[name] = math.inf
            return SpikeEvent(step, name, x, sig.baseline if sig.n else 0.0, math.inf, math.inf)
        if x <= 0.0:  # no gradient (an all-masked batch, loss * 0, an unused layer): no spike, no sample
            return None
        lx = math.log(x)
        if sig.n < max(1, cfg.warmup_steps):
            sig.absorb(lx, cfg.alpha, cfg.baseline_alpha, cfg.warmup_steps)
            return None
        z, ratio = sig.z_ratio(lx)
        self._z[name] = z
        z_eff = cfg.z_thresh * (sig.tail_factor() if cfg.tail_correction else 1.0)
        band = z_eff * math.sqrt(sig.var)
        pending.append((sig, lx, band))
        if name == "global":
            self._last["spike/zscore"], self._last["spike/ratio"] = z, ratio
            self._last["spike/threshold"] = math.exp(sig.mean + max(band, math.log(cfg.min_ratio)))
        if (z > z_eff and ratio > cfg.min_ratio) or (cfg.ratio_thresh is not None and ratio > cfg.ratio_thresh):
            return SpikeEvent(step, name, x, sig.baseline, z, ratio)
        return None

    def _fixed(self, step: int, g: float, n_tokens: int | None, n_micro_batches: int) -> list[SpikeEvent]:
        """GradLoc's trigger: ``g > T / sqrt(max(1, n_tokens)) * n_micro_batches`` (strict)."""
        if n_tokens is None:
            raise ConfigError("spikes.mode='fixed' needs n_tokens (the number of loss tokens in the step): "
                              "pass it to update(), or give the monitor a spike_context")
        if isinstance(n_micro_batches, bool) or not isinstance(n_micro_batches, int) or n_micro_batches < 1:
            raise ConfigError(f"n_micro_batches={n_micro_batches!r} is invalid: use the number of micro-batches "
                              "accumulated into this step (1 or more)")
        thr = self.config.per_token_threshold / math.sqrt(max(1, n_tokens)) * n_micro_batches
        ratio = g / thr
        self._last["spike/threshold"], self._last["spike/ratio"] = thr, ratio
        if not math.isfinite(g) or g > thr:
            return [SpikeEvent(step, "global", g, thr, ratio, ratio)]
        return []

    def _score(self, g: float) -> None:
        if len(self._history) >= min(16, self.config.score_window):
            self._score_seen += 1
            self._score_hits += (not math.isfinite(g)) or self._history.is_spike(g)
        if math.isfinite(g) and g > 0:  # a zero-gradient step is no sample of the norm
            self._history.append(g)

    def state_dict(self) -> dict[str, Any]:
        return {"signals": {k: (s.n, s.mean, s.var, s.m4, s.prev, s.d2) for k, s in self.signals.items()},
                "count": self.count,
                "history": list(self._history), "score": (self._score_hits, self._score_seen),
                "last_step": self._last_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.signals = {k: _Signal(*v) for k, v in state["signals"].items()}  # 3-tuples (0.1): m4 = 0
        self.count = int(state["count"])
        self._history = RunningWindow(self.config.score_window, state["history"])
        self._score_hits, self._score_seen = state["score"]
        self._last_step = state.get("last_step")
