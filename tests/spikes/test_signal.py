"""``LogSignal`` against Holt's linear exponential smoothing written out from the textbook equations
(level ``l_t = a x_t + (1 - a)(l_{t-1} + b_{t-1})``, trend ``b_t = a (l_t - l_{t-1}) + (1 - a) b_{t-1}``,
``a = 1 - baseline_alpha``), the warm-up variance and fourth moment from successive differences
(``E[d^2] = 2 var``, ``E[d^4] = 2 m4 + 6 var^2`` for independent noise) and the tail factor from the
error moments, all recomputed from the whole series in plain loops."""
from __future__ import annotations

import math
import random

import pytest

from gradloc_track.spikes.signal import MAX_TAIL_FACTOR, LogSignal

ALPHA, BASE, WARMUP = 0.99, 0.9, 10


def series(n: int = 60, seed: int = 0) -> list[float]:
    rng = random.Random(seed)
    return [0.02 * t + rng.gauss(0, 0.3) for t in range(n)]  # a rising log-value with noise


def holt(xs: list[float], falls: bool) -> dict[str, float]:
    """The reference: the recursion over the series, then the moments from the forecast errors."""
    a = 1 - BASE
    level, trend = xs[0], 0.0
    errors = []
    for x in xs[1:]:
        forecast = level + (trend if falls else max(trend, 0.0))
        errors.append(x - forecast)
        new_level = a * x + (1 - a) * forecast
        trend = a * (new_level - level) + (1 - a) * trend
        level = new_level
    diffs = [xs[i] - xs[i - 1] for i in range(1, min(len(xs), WARMUP))]
    var = sum(d * d for d in diffs) / len(diffs) / 2  # successive differences: E[d^2] = 2 var
    m4 = max(3 * var * var, (sum(d ** 4 for d in diffs) / len(diffs) - 6 * var * var) / 2)  # E[d^4] = 2 m4 + 6 var^2
    for e in errors[WARMUP - 1:]:  # after warm-up: EMAs of the squared and fourth-power errors
        var = ALPHA * var + (1 - ALPHA) * e * e
        m4 = ALPHA * m4 + (1 - ALPHA) * e ** 4
    return {"level": level, "trend": trend, "var": var, "m4": m4,
            "forecast": level + (trend if falls else max(trend, 0.0))}


@pytest.mark.parametrize("falls", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_level_trend_and_moments_match_holts_equations(falls, seed):
    xs = series(seed=seed) if seed == 0 else [-v for v in series(seed=seed)]  # rising, then falling
    sig = LogSignal(falls=falls)
    for x in xs:
        sig.absorb(x, ALPHA, BASE, WARMUP)
    ref = holt(xs, falls)
    assert sig.mean == pytest.approx(ref["level"], rel=1e-12, abs=1e-12)
    assert sig.trend == pytest.approx(ref["trend"], rel=1e-12, abs=1e-12)
    assert sig.var == pytest.approx(ref["var"], rel=1e-12)
    assert sig.m4 == pytest.approx(ref["m4"], rel=1e-12)
    assert sig.forecast == pytest.approx(ref["forecast"], rel=1e-12, abs=1e-12)
    z, ratio = sig.z_ratio(ref["forecast"] + 1.0)
    assert z == pytest.approx(1.0 / math.sqrt(ref["var"]), rel=1e-9) and ratio == pytest.approx(math.e)
    assert sig.baseline == pytest.approx(math.exp(ref["forecast"]))


def heavy_tailed(n: int) -> list[float]:
    """Small wobbles and one large jump (kurtosis far above 3), as a small batch's norm."""
    return [1.0 if i == n // 2 else 0.05 * (-1) ** i for i in range(n)]


def test_the_warm_up_measures_the_tails_instead_of_assuming_them_gaussian():
    """The fourth moment at the end of warm-up is the successive-difference estimate (the reference:
    the whole window's moments, then ``m4 = (E[d^4] - 6 var^2) / 2``), so a heavy-tailed signal gets
    its tail correction from its first armed step; i.i.d. Gaussian noise stays near 3 var^2."""
    warmup = 40
    xs = heavy_tailed(warmup)
    sig = LogSignal()
    for x in xs:
        sig.absorb(x, ALPHA, BASE, warmup)
    d = [xs[i] - xs[i - 1] for i in range(1, warmup)]
    e2, e4 = sum(v * v for v in d) / len(d), sum(v ** 4 for v in d) / len(d)
    assert sig.var == pytest.approx(e2 / 2, rel=1e-12)
    assert sig.m4 == pytest.approx(max(3 * (e2 / 2) ** 2, (e4 - 6 * (e2 / 2) ** 2) / 2), rel=1e-12)
    assert sig.tail_factor() > 1.2  # the old start (m4 = 3 var^2) gave 1.0 here
    rng = random.Random(1)
    gauss = [rng.gauss(0, 0.1) for _ in range(2000)]
    g = LogSignal()
    for x in gauss:
        g.absorb(x, ALPHA, BASE, len(gauss))
    assert g.m4 / g.var ** 2 == pytest.approx(3.0, abs=0.5) and g.tail_factor() < 1.05


def test_a_falling_trend_is_extrapolated_for_smooth_signals_only():
    xs = [-0.05 * t for t in range(30)]
    rough, smooth = LogSignal(), LogSignal(falls=True)
    for x in xs:
        rough.absorb(x, ALPHA, BASE, WARMUP)
        smooth.absorb(x, ALPHA, BASE, WARMUP)
    assert smooth.trend < 0 and smooth.forecast == pytest.approx(smooth.mean + smooth.trend)
    assert rough.forecast == rough.mean  # a heavy-tailed norm's baseline does not run ahead of a fall


def test_a_fired_value_moves_the_level_but_teaches_neither_trend_nor_moments():
    xs = series()
    sig = LogSignal()
    for x in xs:
        sig.absorb(x, ALPHA, BASE, WARMUP)
    before = sig.as_tuple()
    f = sig.forecast
    sig.absorb(f + 5.0, ALPHA, BASE, WARMUP, moments=False)
    assert sig.mean == pytest.approx(f + (1 - BASE) * 5.0)
    assert (sig.trend, sig.var, sig.m4) == (before[6], before[2], before[3])


def test_tail_factor_is_the_clamped_fourth_root_of_kurtosis_over_three():
    assert LogSignal().tail_factor() == 1.0  # no variance yet
    assert LogSignal(var=1.0, m4=3.0).tail_factor() == 1.0  # Gaussian
    assert LogSignal(var=1.0, m4=12.0).tail_factor() == pytest.approx((12 / 3) ** 0.25)
    assert LogSignal(var=1.0, m4=1e6).tail_factor() == MAX_TAIL_FACTOR
    assert LogSignal(var=1.0, m4=1.0).tail_factor() == 1.0  # lighter tails never lower the threshold


def test_log_signal_round_trips_through_state():
    sig = LogSignal()
    for x in (0.1, 0.3, -0.2, 0.05):
        sig.absorb(x, 0.99, 0.9, 2)
    assert LogSignal(*sig.as_tuple()) == sig


def test_a_ratio_beyond_floats_range_is_reported_not_raised():
    """A baseline of 1e-300 then a value of 1e300 (float64 inputs): the ratio's exp() would overflow."""
    from gradloc_track.spikes import SpikeDetector

    det = SpikeDetector(warmup_steps=2)
    for step, x in enumerate([1e-300, 1e-300, 1e-300]):
        assert det.update(step, x) == []
    (event,) = det.update(3, 1e300)
    assert event.signal == "global" and math.isfinite(event.ratio) and event.ratio > 1e300
