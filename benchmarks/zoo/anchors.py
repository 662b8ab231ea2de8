"""The anchors' triggers replayed on a zoo stream, as their authors publish them, and ours.

Each trigger takes a run's ``StepRecord``s and returns the steps it fires on:

- ``gradloc``: GradLoc's fixed trigger, global norm > ``T / sqrt(n_tokens)`` (Tencent-Hunyuan/GradLoc,
  one micro-batch). ``T`` has no default that fits another model's scale, so it is calibrated on a
  separate clean run of the family: the highest clean ``global * sqrt(n_tokens)`` (no false alarm there).
  ``NaN > T`` is false: it never fires on a non-finite norm.
- ``zclip``: ZClip's z-score on the global norm (bluorion-com/ZClip ``zclip.py``): 25 warm-up norms give
  the mean and population variance, then ``z = (g - mean) / (std + 1e-6) > 2.5`` fires; the EMAs
  (alpha 0.97) take the adaptive threshold on a spike, the norm otherwise. A NaN norm never fires
  (``NaN > 2.5`` is false); we keep it out of the EMA (the package would take it in and stop working).
- ``olmo``: OLMo-core's ``SkipStepOptimizer``: once ``max(20, 128 // 2)`` losses are seen, fire when the
  loss or the grad norm is more than 6 standard deviations (``torch.std``, unbiased, two-sided) from
  the mean of the previous up to 128 values; NaN fires (it fails ``z <= 6``). Without a loss, the
  grad norm alone. A non-finite value is kept out of the window (OLMo-core's would hold it, and fire on
  every step, for 128 steps).
- ``ours``: ``SpikeDetector`` replayed with what the monitor fed it live (``StepRecord.fed``), so a
  replay of the same configuration fires where the run did; ``ours 0.3``: 0.3's detector (global and
  per-layer norms only), ``zoo/detector_03.py``.
"""
from __future__ import annotations

import inspect
import math
import statistics
from typing import Any, Callable

from .record import StepRecord

Trigger = Callable[[list[StepRecord]], set[int]]


def gradloc_threshold(clean: list[list[StepRecord]], warmup: int) -> float:
    """GradLoc's per-token ``T`` at the highest clean value of ``global * sqrt(n_tokens)``."""
    vals = [r.global_norm * math.sqrt(max(1, r.n_tokens)) for run in clean for r in run[warmup:]
            if math.isfinite(r.global_norm)]
    return max(vals) if vals else math.inf


def gradloc(T: float) -> Trigger:
    def fire(steps: list[StepRecord]) -> set[int]:
        return {r.step for r in steps if r.global_norm > T / math.sqrt(max(1, r.n_tokens))}

    return fire


def zclip(steps: list[StepRecord], alpha: float = 0.97, z_thresh: float = 2.5, warmup: int = 25,
          eps: float = 1e-6) -> set[int]:
    buf: list[float] = []
    mean = var = 0.0
    out = set()
    for r in steps:
        g = r.global_norm
        if len(buf) < warmup:
            if math.isfinite(g):
                buf.append(g)
                if len(buf) == warmup:
                    mean = sum(buf) / warmup
                    var = sum((x - mean) ** 2 for x in buf) / warmup
            continue
        if not math.isfinite(g):
            continue
        std = math.sqrt(var)
        z = (g - mean) / (std + eps)
        x = g
        if z > z_thresh:
            out.add(r.step)
            x = mean + z_thresh * std / (z / z_thresh)
        mean = alpha * mean + (1 - alpha) * x
        var = alpha * var + (1 - alpha) * (x - mean) ** 2
    return out


def _olmo_z(hist: list[float], x: float) -> float:
    if len(hist) < 2:
        return 0.0
    try:
        mean, std = statistics.fmean(hist), statistics.stdev(hist)
    except (ValueError, OverflowError):
        return math.nan
    return abs(x - mean) / std if std > 0 else (0.0 if x == mean else math.inf)


def olmo(steps: list[StepRecord], window: int = 128, sigma: float = 6.0) -> set[int]:
    losses: list[float] = []
    norms: list[float] = []
    out = set()
    for r in steps:
        loss = r.loss if r.loss is not None else 0.0
        if len(losses) + 1 >= max(20, window // 2):
            zl, zg = _olmo_z(losses[-window:], loss), _olmo_z(norms[-window:], r.global_norm)
            if not (zl <= sigma and zg <= sigma):
                out.add(r.step)
        if math.isfinite(loss) and math.isfinite(r.global_norm):  # a NaN would stay in the window 128 steps
            losses.append(loss)
            norms.append(r.global_norm)
            losses, norms = losses[-window:], norms[-window:]
    return out


def ours(config: Any = None, **overrides: Any) -> Trigger:
    """The library's ``SpikeDetector`` (its current code) fed what the monitor fed it."""
    from gradloc_track.config import SpikeConfig
    from gradloc_track.spikes import SpikeDetector

    def fire(steps: list[StepRecord]) -> set[int]:
        det = SpikeDetector(config or SpikeConfig(**overrides))
        params = inspect.signature(det.update).parameters
        out = set()
        for r in steps:
            extra = {k: v for k, v in (r.fed if r.fed is not None else signals_of(r)).items() if k in params}
            if "junk_text" in extra:  # the text the live detector read: asked for the same way
                extra["junk_text"] = (lambda text: lambda: text)(extra["junk_text"])
            if det.update(r.step, r.global_norm, r.layers, n_tokens=r.n_tokens, **extra):
                out.add(r.step)
        return out

    return fire


def with_span(trigger: Trigger, width: str, **overrides: Any) -> Trigger:
    """``trigger`` plus a span-loss signal of its own: the largest mean loss over ``width`` consecutive
    terms (``StepRecord.span_max``, the zoo's measurement; ``c16``: a 16-term span's excess over the
    rest of its row) fed to a second ``SpikeDetector`` as its largest sample loss, every other signal
    off. A candidate, not the library's default (docs/benchmarks.md)."""
    from gradloc_track.config import SpikeConfig
    from gradloc_track.spikes import SpikeDetector

    def fire(steps: list[StepRecord]) -> set[int]:
        det = SpikeDetector(SpikeConfig(loss_signal=False, update_signal=False, per_layer=False, noise_floor=0.0,
                                        **overrides))
        out = set()
        for r in steps:
            v = (r.span_max or {}).get(width)
            if v is not None and math.isfinite(v) and v > 0 and det.update(r.step, 1.0, sample_losses=[v]):
                out.add(r.step)
        return out | trigger(steps)

    return fire


def signals_of(r: StepRecord) -> dict[str, Any]:
    """The step's extra inputs, under the names ``SpikeDetector.update`` takes them (after issue 26)."""
    return {"loss": r.loss, "sample_losses": r.sample_losses, "lr": r.lr, "update": r.update,
            "update_layers": r.update_layers, "weight_norm": r.weight_norm}


def live(steps: list[StepRecord]) -> set[int]:
    """What the detector did in the run itself."""
    return {r.step for r in steps if r.fired}
