"""The spike detector against independent references: the EMA equations, real small-batch noise, resume.

Its statistics survive what it sees: a zero-gradient step is not a spike and does not enter them
(issue 17), no stream of degenerate steps poisons it, and a spike it caught does not raise its
threshold (issue 22)."""
from __future__ import annotations

import math
import random

import pytest
import torch

from gradloc_track.config import ConfigError
from gradloc_track.spikes import SpikeDetector

from ..degenerate_streams import CLEAN, DIRTY, WARMUP, degenerate_stream, model3


def real_layer_norms(model, steps):
    """Per-layer grad norms of a real small model over a few SGD steps on random tokens."""
    from gradloc_track.grouping import layer_of

    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        x = torch.randint(0, 64, (4, 16), generator=g)
        opt.zero_grad()
        logits = model(x[:, :-1])
        torch.nn.functional.cross_entropy(logits.reshape(-1, 64), x[:, 1:].reshape(-1)).backward()
        layers: dict[str, float] = {}
        for n, p in model.named_parameters():
            layers[layer_of(n)] = layers.get(layer_of(n), 0.0) + p.grad.norm().item() ** 2
        out.append({k: math.sqrt(v) for k, v in layers.items()})
        opt.step()
    return out


def test_single_layer_spike_caught_while_global_stays_calm(tiny_gpt):
    history = real_layer_norms(tiny_gpt, 60)
    det = SpikeDetector(warmup_steps=20)
    small = min(history[0], key=history[0].get)  # the layer with the smallest share of the norm
    fired = []
    for step, layers in enumerate(history):
        layers = dict(layers)
        if step == 50:
            layers[small] *= 20
        glob = math.sqrt(sum(v * v for v in layers.values()))
        events = det.update(step, glob, layers)
        fired += events
        if step == 50:
            assert not any(e.signal == "global" for e in events), "global norm should not fire"
    assert [(e.step, e.signal) for e in fired] == [(50, small)]
    assert fired[0].ratio == pytest.approx(20, rel=0.6)


def test_no_events_on_realistic_noise():
    rng = random.Random(0)
    det = SpikeDetector(warmup_steps=20)
    for step in range(500):
        layers = {f"h.{i}": math.exp(rng.gauss(0, 0.25)) * (i + 1) for i in range(6)}
        assert det.update(step, math.sqrt(sum(v * v for v in layers.values())), layers) == []
    assert det.metrics()["spike/detected_total"] == 0


def test_no_events_during_warmup():
    det = SpikeDetector(warmup_steps=10)
    for step in range(10):
        assert det.update(step, 1.0 if step < 9 else 100.0) == []
    assert det.update(10, 100.0 * 10)  # after warm-up the same kind of jump fires


def reference_stats(logs, warmup, alpha, baseline_alpha):
    """The detector's statistics written out from its docstring (Holt's level and trend, decay
    baseline_alpha, a norm's forecast extrapolating a rising trend only; forecast error moments, decay
    alpha): warm-up variance and fourth moment from successive differences (E[d^2] = 2 var, E[d^4] =
    2 m4 + 6 var^2, m4 at least its Gaussian value), then EMAs of the forecast errors. Returns (level,
    var, m4, trend)."""
    level, trend = logs[0], 0.0
    d2 = d4 = var = m4 = 0.0
    for n, x in enumerate(logs[1:], start=2):
        forecast = level + max(trend, 0.0)
        d = x - forecast
        new_level = forecast + (1 - baseline_alpha) * d
        trend += (1 - baseline_alpha) * (new_level - level - trend)
        level = new_level
        if n <= warmup:
            d2 += ((x - logs[n - 2]) ** 2 - d2) / (n - 1)
            d4 += ((x - logs[n - 2]) ** 4 - d4) / (n - 1)
            var = d2 / 2
            m4 = max(3 * var ** 2, (d4 - 6 * var ** 2) / 2)
        else:
            var = alpha * var + (1 - alpha) * d * d
            m4 = alpha * m4 + (1 - alpha) * d ** 4
    return level, var, m4, trend


def test_ema_statistics_match_the_equations():
    det = SpikeDetector(warmup_steps=4, alpha=0.9, baseline_alpha=0.8, z_thresh=50, tail_correction=False)
    xs = [1.0, 2.0, 1.5, 1.2, 1.4, 1.9, 1.1, 1.3]
    for s, x in enumerate(xs):
        det.update(s, x)
    mean, var, m4, trend = reference_stats([math.log(x) for x in xs], 4, 0.9, 0.8)
    sig = det.signals["global"]
    assert (sig.mean, sig.var, sig.m4, sig.trend) == (pytest.approx(mean), pytest.approx(var), pytest.approx(m4),
                                                      pytest.approx(trend))
    det.update(8, 5.0)
    f = mean + max(trend, 0.0)
    z = (math.log(5.0) - f) / math.sqrt(var)
    assert det.metrics()["spike/zscore"] == pytest.approx(z, rel=1e-6)
    assert det.metrics()["spike/ratio"] == pytest.approx(5.0 / math.exp(f), rel=1e-6)
    # the norm that would fire: the z rule's, or the ratio_thresh safety net's when that is lower (it fires
    # whatever the noise: round 9's threshold read 101x the mean where the 20x net fired)
    want = min(math.exp(f + 50 * math.sqrt(var)), math.exp(f) * det.config.ratio_thresh)
    assert det.metrics()["spike/threshold"] == pytest.approx(want, rel=1e-6)
    assert math.exp(f + 50 * math.sqrt(var)) > math.exp(f) * det.config.ratio_thresh  # the net is what binds here


def test_a_steady_rise_is_followed_not_fired_on():
    """A layer norm growing 6% a step, as ln_f does in the zoo's first 40 steps: 0.3's plain EMA lagged
    it by ~0.5 in log space and fired twenty steps in a row; the trend follows it."""
    rng = random.Random(7)
    det = SpikeDetector(warmup_steps=20)
    fired = [s for s in range(120) if det.update(s, 1.0, {"ln_f": 0.03 * math.exp(0.06 * min(s, 60)
                                                                                  + rng.gauss(0, 0.02))})]
    assert fired == []


def test_a_level_shift_is_taken_in_after_a_few_steps():
    """A norm that steps up 3x for good fires a few times, then is the new normal (0.3 could lock into
    firing: a caught step moved the baseline by a tenth of the band at most)."""
    rng = random.Random(8)
    det = SpikeDetector(warmup_steps=20)
    fired = [s for s in range(200) if det.update(s, math.exp(rng.gauss(0, 0.05)) * (3.0 if s >= 100 else 1.0))]
    assert fired and all(100 <= s < 104 for s in fired)


def test_warmup_variance_ignores_a_steady_trend():
    """Early training: norms fall 3% a step with 5% noise. Successive differences see the noise,
    not the trend (a plain variance over the warm-up would be ~5x larger)."""
    rng = random.Random(5)
    logs = [-0.03 * t + rng.gauss(0, 0.05) for t in range(40)]
    det = SpikeDetector(warmup_steps=40)
    for s, lx in enumerate(logs):
        det.update(s, math.exp(lx))
    plain = sum((x - sum(logs) / 40) ** 2 for x in logs) / 40
    assert det.signals["global"].var < 0.005 < plain


def test_spike_is_reported_with_its_baseline_and_does_not_poison_it():
    det = SpikeDetector(warmup_steps=5)
    for s in range(30):
        det.update(s, 1.0 + 0.01 * (s % 3))
    base = det.signals["global"].baseline
    (ev,) = det.update(30, 10.0)
    assert (ev.step, ev.signal, ev.value) == (30, "global", 10.0)
    assert ev.baseline == pytest.approx(base) and ev.ratio == pytest.approx(10.0 / base)
    assert det.signals["global"].baseline < 1.1  # absorbed clipped, not at 10


def test_nonfinite_always_fires():
    det = SpikeDetector(warmup_steps=5)
    (ev,) = det.update(0, float("nan"))
    assert ev.z == math.inf and det.signals["global"].n == 0


def test_fixed_mode_is_gradlocs_knob():
    det = SpikeDetector(mode="fixed", per_token_threshold=640.0)
    n = 4096
    assert det.update(0, 640 / math.sqrt(n) * 0.99, n_tokens=n) == []
    (ev,) = det.update(1, 640 / math.sqrt(n) * 1.5, n_tokens=n)
    assert ev.baseline == pytest.approx(10.0) and ev.ratio == pytest.approx(1.5)
    with pytest.raises(ConfigError, match="n_tokens"):
        det.update(2, 1.0)


def test_resume_equivalence():
    rng = random.Random(2)
    xs = [1 + rng.random() for _ in range(80)] + [30.0] + [1 + rng.random() for _ in range(10)]
    full = SpikeDetector(warmup_steps=10)
    ev_full = [e for s, x in enumerate(xs) for e in full.update(s, x, {"h.0": x / 2})]
    a = SpikeDetector(warmup_steps=10)
    for s, x in enumerate(xs[:40]):
        a.update(s, x, {"h.0": x / 2})
    b = SpikeDetector(warmup_steps=10)
    b.load_state_dict(a.state_dict())
    ev_b = [e for s, x in enumerate(xs[40:], start=40) for e in b.update(s, x, {"h.0": x / 2})]
    assert ev_b == [e for e in ev_full if e.step >= 40] and ev_b
    assert b.metrics() == full.metrics()


def test_a_state_saved_under_ddp_keeps_its_layer_statistics():
    """Layer names saved with DDP's module. (before it was dropped) load under the bare names."""
    rng = random.Random(3)
    a = SpikeDetector(warmup_steps=5)
    for s in range(20):
        x = 1 + rng.random()
        a.update(s, x, {"module.h.0": x / 2, "module.h.1": x / 3})
    old = {k: v for k, v in a.state_dict().items() if k != "names_as_read"}  # as states were saved then
    b = SpikeDetector(warmup_steps=5)
    b.load_state_dict(old)
    assert set(b.state_dict()["signals"]) == {"global", "h.0", "h.1"}
    assert b.state_dict()["signals"]["h.0"] == a.state_dict()["signals"]["module.h.0"]
    # names saved now are as the monitor read them: a user's own submodule called ``module`` keeps its name
    c = SpikeDetector(warmup_steps=5)
    c.load_state_dict(a.state_dict())
    assert c.state_dict()["signals"] == a.state_dict()["signals"]


# -- calibration on a real model (issue 13): clean small-batch training must not fire ------------

def clean_stream(batch, seq, steps):
    """Global and per-layer grad norms of a real tiny GPT training cleanly on the demo corpus."""
    from gradloc_track import GradMonitor
    from gradloc_track.demo.data import TextBatches, load_corpus
    from gradloc_track.demo.model import TinyGPT

    torch.manual_seed(0)
    model = TinyGPT(vocab_size=256, n_layer=2, n_head=2, d_model=32, max_seq_len=seq)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    mon = GradMonitor(model, weight_norms=False)
    data = TextBatches(load_corpus(), seq, batch, seed=0)
    out = []
    for step in range(steps):
        b = data.batch(step)  # (B, T+1)
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(b[:, :-1]).reshape(-1, 256), b[:, 1:].reshape(-1)).backward()
        stats = mon.after_backward(step)
        out.append((stats.global_norm, stats.layer_norms))
        opt.step()
    return out


@pytest.fixture(scope="module")
def small_batch_stream():
    return clean_stream(4, 32, 300)


def fired_steps(det, stream, inject=None):
    inject = inject or {}
    fired = {}
    for step, (g, layers) in enumerate(stream):
        if step in inject:
            g, layers = inject[step](g, layers)
        events = det.update(step, g, layers)
        if events:
            fired[step] = [e.signal for e in events]
    return fired


def test_clean_small_batches_do_not_fire(small_batch_stream):
    """4x32 tokens: 0.1's settings (a 3x ratio rule, alpha 0.98 for mean and variance, no tail correction) fired
    every ~10 steps on this clean run; the calibrated default fires on none of them."""
    old = fired_steps(SpikeDetector(alpha=0.98, baseline_alpha=0.98, ratio_thresh=3.0, tail_correction=False),
                      small_batch_stream)
    assert len(old) >= 5, old  # the finding reproduces on this stream
    assert fired_steps(SpikeDetector(), small_batch_stream) == {}


@pytest.mark.parametrize("kind", ["global_x10", "layer_x20"])
def test_calibrated_detector_still_catches_spikes_in_small_batch_noise(small_batch_stream, kind):
    """This tiny model's log-norms wobble by 0.3-0.75 (1 sigma) at 4x32, so a 10x jump of every
    norm is a ~7 sigma event; a 20x jump of the smallest layer alone leaves the global norm calm. The step
    fires either way. Since z_thresh 8 (stop 59) the 10x jump's global norm (z ~7.7) is under its own bar and fires
    on the broad rule (stop 60: every layer moved with it), beside the layer furthest out (lm_head)."""
    layer = min(small_batch_stream[0][1], key=small_batch_stream[0][1].get)

    def spike(g, layers):
        layers = dict(layers)
        if kind == "global_x10":
            return g * 10, {k: v * 10 for k, v in layers.items()}
        old, layers[layer] = layers[layer], layers[layer] * 20
        return math.sqrt(g * g - old * old + layers[layer] ** 2), layers

    fired = fired_steps(SpikeDetector(), small_batch_stream, {250: spike})
    assert list(fired) == [250]
    if kind == "global_x10":
        assert fired[250] == ["global", "lm_head"]  # the broad rule's global event, and the layer furthest out
        assert fired_steps(SpikeDetector(broad_z=None), small_batch_stream, {250: spike})[250] == ["lm_head"]
        assert "global" in fired_steps(SpikeDetector(z_thresh=7), small_batch_stream, {250: spike})[250]
    else:
        assert fired[250] == [layer]


def test_tail_correction_follows_the_fourth_moment():
    """z_eff = z_thresh * clamp((m4 / v^2 / 3) ** 0.25, 1, 2), with m4 an EMA like v."""
    rng = random.Random(3)
    xs = [math.exp(rng.gauss(0, 0.2) if rng.random() > 0.05 else rng.gauss(0, 0.8)) for _ in range(200)]
    det = SpikeDetector(warmup_steps=10, alpha=0.95, z_thresh=50, ratio_thresh=None)  # nothing fires
    for s, x in enumerate(xs):
        det.update(s, x)
    mean, var, m4, trend = reference_stats([math.log(x) for x in xs], 10, 0.95, 0.9)
    sig = det.signals["global"]
    assert (sig.mean, sig.var, sig.m4) == (pytest.approx(mean), pytest.approx(var), pytest.approx(m4))
    factor = min(2.0, max(1.0, (m4 / var ** 2 / 3) ** 0.25))
    assert factor > 1.05  # heavy-tailed input: the correction is active
    assert sig.tail_factor() == pytest.approx(factor)
    det.update(200, 1.0)
    threshold = math.exp(mean + max(trend, 0.0) + max(50 * factor * math.sqrt(var), math.log(1.5)))
    assert det.metrics()["spike/threshold"] == pytest.approx(threshold, rel=1e-9)


def gradloc_trigger(grad_norm, T, tokens_per_micro_batch):
    """GradLoc's rule as published (patches/gradloc.patch): spike iff
    ||g|| > T / sqrt(max(1, total tokens over all micro-batches)) * number of micro-batches."""
    total = sum(tokens_per_micro_batch)
    return grad_norm > T / math.sqrt(max(1, total)) * len(tokens_per_micro_batch)


def test_fixed_mode_equals_gradlocs_trigger_with_micro_batches():
    rng = random.Random(4)
    for _ in range(300):
        T = rng.choice([100.0, 640.0])
        tokens = [rng.randrange(0, 2048) for _ in range(rng.randint(1, 8))]
        thr = T / math.sqrt(max(1, sum(tokens))) * len(tokens)
        g = thr * rng.choice([0.5, 0.999, 1.0, 1.001, 3.0])
        det = SpikeDetector(mode="fixed", per_token_threshold=T)
        events = det.update(0, g, n_tokens=sum(tokens), n_micro_batches=len(tokens))
        assert bool(events) == gradloc_trigger(g, T, tokens), (g, T, tokens)
        assert det.metrics()["spike/threshold"] == pytest.approx(thr)
    with pytest.raises(ConfigError, match="n_micro_batches"):
        SpikeDetector(mode="fixed", per_token_threshold=100.0).update(0, 1.0, n_tokens=10, n_micro_batches=0)


def test_a_repeated_step_does_not_advance_the_statistics():
    det = SpikeDetector(warmup_steps=2)
    for s in range(5):
        det.update(s, 1.0 + 0.1 * s)
    before = det.state_dict()
    with pytest.warns(UserWarning, match="twice for step 4"):
        assert det.update(4, 100.0) == []
    assert det.state_dict() == before


def test_metric_names_say_what_they_are():
    det = SpikeDetector(warmup_steps=3)
    for s in range(20):
        det.update(s, 1.0 + 0.01 * (s % 2), {"h.0": 0.5})
    (ev,) = [e for e in det.update(20, 50.0, {"h.0": 0.5}) if e.signal == "global"]
    m = det.metrics()
    assert set(m) == {"spike/detected", "spike/detected_total", "spike/threshold", "spike/ratio", "spike/zscore",
                      "spike/zscore_max_layer", "spike/olmo_score"}
    assert m["spike/detected"] == 1.0 and m["spike/detected_total"] == 1.0
    assert m["spike/zscore"] == pytest.approx(ev.z) and m["spike/ratio"] == pytest.approx(ev.ratio)
    assert m["spike/threshold"] < 50.0  # the norm crossed the logged threshold
    assert m["spike/olmo_score"] > 0  # OLMo's 6-sigma rule agrees on a 50x jump


@pytest.mark.parametrize("seed", range(6))
def test_no_degenerate_stream_poisons_the_detector(seed):
    model = model3()
    names = [n for n, _ in model.named_parameters()]
    det = SpikeDetector(warmup_steps=WARMUP)
    stream = degenerate_stream(model, seed)
    fired = []
    for t, grads in enumerate(stream):
        layers = {n: 0.0 if g is None else g.double().norm().item() for n, g in zip(names, grads)}
        total = math.sqrt(sum(v * v for v in layers.values()))
        if det.update(t, total, layers):
            fired.append(t)
        thr = det.metrics().get("spike/threshold")
        assert thr is None or (math.isfinite(thr) and thr > 0), (t, thr)
    # it fires on the non-finite steps and on the spike, never on the clean stretch
    assert [t for t in fired if t >= DIRTY] == [DIRTY + CLEAN]
    assert all(math.isfinite(v) for s in det.signals.values() for v in (s.mean, s.var, s.m4))


def noisy_layers(rng: random.Random) -> dict[str, float]:
    return {f"h.{i}": math.exp(rng.gauss(0, 0.2)) * (i + 1) for i in range(3)}


def run(steps: int, seed: int = 0, edit=None) -> tuple[list[int], list[float]]:
    """Steps that fired, and ``spike/threshold`` after each step, on log-normal layer noise;
    ``edit(step, layers)`` may change a step's layer norms (None: the detector does not see the step)."""
    rng = random.Random(seed)
    det = SpikeDetector(warmup_steps=20)
    fired, thr = [], []
    for s in range(steps):
        layers = noisy_layers(rng)
        if edit is not None:
            layers = edit(s, layers)
        if layers is None:
            thr.append(thr[-1])
            continue
        if det.update(s, math.sqrt(sum(v * v for v in layers.values())), layers):
            fired.append(s)
        thr.append(det.metrics().get("spike/threshold", math.nan))
    return fired, thr


@pytest.mark.parametrize("zero_at", [5, 80])  # in warm-up and after
def test_a_zero_gradient_step_is_no_spike_and_changes_nothing(zero_at):
    """0.2: ~8 firings after the zero step, spike/threshold up to 8.8e32 (2e35 here)."""
    fired, thr = run(120, edit=lambda s, lay: {k: 0.0 for k in lay} if s == zero_at else lay)
    clean_fired, clean_thr = run(120)
    assert fired == clean_fired == []
    finite = [t for t in thr[20:] if not math.isnan(t)]
    assert finite and all(math.isfinite(t) and 0 < t < 10 * max(clean_thr[20:]) for t in finite)


def test_non_finite_steps_fire_but_never_enter_the_statistics():
    nan_steps = (30, 60)
    fired, thr = run(100, edit=lambda s, lay: {**lay, "h.1": math.nan} if s in nan_steps else lay)
    unseen_fired, unseen_thr = run(100, edit=lambda s, lay: None if s in nan_steps else lay)
    assert fired == list(nan_steps) and unseen_fired == []
    assert thr[-1] == unseen_thr[-1]  # as if the NaN steps had never been seen


SPIKES = {  # how the step-100 spike shows: on every signal, or on one layer only (the spike demo's case)
    "every layer x30": (lambda lay: {k: v * 30.0 for k, v in lay.items()}, {"global", "h.0", "h.1", "h.2"}),
    "one layer x6, the global norm below its threshold": (lambda lay: {**lay, "h.0": lay["h.0"] * 6.0}, {"h.0"}),
}


@pytest.mark.parametrize("kind", list(SPIKES))
def test_one_caught_spike_leaves_the_threshold_within_noise(kind):
    """0.2: spike/threshold went from ~2.4 to ~4.6 at the demo's step 100 and stayed there (the
    spike was caught on a layer; the global norm, just below its threshold, entered its variance)."""
    spike_at = 100
    scale, signals = SPIKES[kind]
    rng = random.Random(0)
    det = SpikeDetector(warmup_steps=20)
    for s in range(spike_at + 1):
        lay = noisy_layers(rng)
        lay = scale(lay) if s == spike_at else lay
        events = det.update(s, math.sqrt(sum(v * v for v in lay.values())), lay)
    assert {e.signal for e in events} == signals
    fired, thr = run(160, edit=lambda s, lay: scale(lay) if s == spike_at else lay)
    clean_fired, clean_thr = run(160)
    assert fired == [spike_at] and clean_fired == []
    # the same noise without the spike is the reference: right after the spike the threshold is
    # within a few percent of it (the baseline absorbed one clipped value), and 10 steps on it is
    # closer to it than the threshold's own step-to-step wobble
    wobble = max(abs(math.log(a / b)) for a, b in zip(clean_thr[60:], clean_thr[61:]))
    assert abs(math.log(thr[spike_at + 1] / clean_thr[spike_at + 1])) < 0.2
    for s in range(spike_at + 10, 160):
        assert abs(math.log(thr[s] / clean_thr[s])) < wobble, s


def test_the_running_window_decides_as_the_two_pass_spike_rule():
    from gradloc_track.spikes.score import RunningWindow, is_spike

    rng = random.Random(3)
    win = RunningWindow(32)
    for i in range(2000):
        v = math.exp(rng.gauss(0, 0.3)) * (rng.choice([1, 1, 1, 8]) if i % 50 == 0 else 1)
        assert win.is_spike(v) == is_spike(win.values, v)
        assert win.is_spike(v * 1.3) == is_spike(win.values, v * 1.3)
        win.append(v)


def _falling_run(det, steps, fall=lambda s: 6.0 * math.exp(-s / 40) + 2.0, jump_at=None, jump=2.5, **extra):
    """Feed ``steps`` steps: a loss falling along ``fall``, a steady norm (a little noise), a norm
    ``jump`` x at ``jump_at``; returns {step: signals that fired}."""
    import random

    rng = random.Random(0)
    fired = {}
    for s in range(steps):
        g = 1.0 * math.exp(rng.gauss(0, 0.05)) * (jump if s == jump_at else 1.0)
        ev = det.update(s, g, {"h.0": g}, loss=fall(s), **extra)
        if ev:
            fired[s] = [e.signal for e in ev]
    return fired


def test_a_norm_jump_in_early_trainings_fall_is_not_an_event_and_fires_once_the_fall_slows():
    """Issue 37: every byte-level run fired at steps 59-85, just after a fixed warm-up, on the early
    transient. The warm-up follows the loss curve: past warmup_steps, gradient norms that jump alone do
    not fire while the loss still falls faster than a tenth of its fastest fall (spikes.transient_fall)."""
    from gradloc_track.spikes import SpikeDetector

    early = SpikeDetector(warmup_steps=20)
    assert 30 not in _falling_run(early, 40, jump_at=30)  # the loss still falls fast at 30
    assert early.metrics()["spike/transient"] == 1.0
    late = SpikeDetector(warmup_steps=20)
    assert _falling_run(late, 200, jump_at=150)[150] == ["global", "h.0"]  # the fall has slowed by 150
    assert late.metrics()["spike/transient"] == 0.0
    fixed = SpikeDetector(warmup_steps=20, transient_fall=0.0)  # off: the fixed warm-up alone, as before
    assert _falling_run(fixed, 40, jump_at=30)[30] == ["global", "h.0"]
    resumed = SpikeDetector(warmup_steps=20)  # resumed after the transient ended: 0 as in the run it resumes
    resumed.load_state_dict(late.state_dict())  # (tester round 12: the key came and went with a resume)
    resumed.update(200, 1.0, {"h.0": 1.0}, loss=2.0)
    assert resumed.metrics()["spike/transient"] == 0.0


def test_the_transient_lasts_while_the_loss_falls_a_tenth_of_its_fastest():
    """The dev half of the held-out zoo chose spikes.transient_fall = 0.1 (HF models' clean false events 7 -> 3
    in 6600 steps, every harmful step still found; docs/benchmarks.md): on a loss falling as 6 exp(-s/20) + 2
    the transient ends at step 77, where a quarter of the fastest fall ended it at 62. A norm jump at 70 is
    quiet; at 0.25 it fired."""
    from gradloc_track.spikes import SpikeDetector

    fall = lambda s: 6.0 * math.exp(-s / 20) + 2.0  # noqa: E731
    assert 70 not in _falling_run(SpikeDetector(warmup_steps=20), 75, fall=fall, jump_at=70)
    quarter = SpikeDetector(warmup_steps=20, transient_fall=0.25)
    assert _falling_run(quarter, 75, fall=fall, jump_at=70)[70] == ["global", "h.0"]
    ends = SpikeDetector(warmup_steps=20)
    _falling_run(ends, 80, fall=fall)
    assert ends.transient.over


def test_in_the_transient_what_is_never_noise_still_fires():
    from gradloc_track.spikes import SpikeDetector

    net = SpikeDetector(warmup_steps=20)
    assert "global" in _falling_run(net, 40, jump_at=30, jump=50.0)[30]  # the 20x safety net
    nan = SpikeDetector(warmup_steps=20)
    assert "global" in _falling_run(nan, 40, jump_at=30, jump=math.inf)[30]
    loss = SpikeDetector(warmup_steps=20)
    fired = _falling_run(loss, 40, fall=lambda s: (6.0 * math.exp(-s / 40) + 2.0) * (3.0 if s == 30 else 1.0),
                         jump_at=30)
    assert "loss" in fired[30]  # a norm jump beside a loss that jumps is not the transient's


def test_in_the_transient_the_safety_net_is_the_steps_gradient_not_one_layers():
    """Dev GPT-2 (dropout on) fired at steps 62 and 66 in the transient: the position embedding's gradient
    81x and 45x its mean, the step's 2.8x and 2.5x. A small layer's ratio is no measure of the step's
    gradient: in the transient the 20x safety net reads the global norm only."""
    import random

    from gradloc_track.spikes import SpikeDetector

    def run(wpe_jump, global_jump):
        det, rng, fired = SpikeDetector(warmup_steps=20), random.Random(0), {}
        for s in range(40):
            g = math.exp(rng.gauss(0, 0.05)) * (global_jump if s == 30 else 1.0)
            layers = {"h.0": g, "wpe": 0.01 * math.exp(rng.gauss(0, 0.05)) * (wpe_jump if s == 30 else 1.0)}
            ev = det.update(s, g, layers, loss=6.0 * math.exp(-s / 40) + 2.0)
            if ev:
                fired[s] = sorted(e.signal for e in ev)
        return fired

    assert 30 not in run(wpe_jump=80.0, global_jump=2.8)  # fired on wpe's 80x before
    assert run(wpe_jump=80.0, global_jump=30.0)[30] == ["global", "h.0", "wpe"]  # the step's own 30x still fires


def test_the_transient_ends_by_four_warm_ups_and_needs_the_loss():
    from gradloc_track.spikes import SpikeDetector

    steady_fall = SpikeDetector(warmup_steps=20)  # a loss that keeps falling 2% a step: capped at 80 steps
    fired = _falling_run(steady_fall, 100, fall=lambda s: 8.0 * 0.98 ** s, jump_at=90)
    assert 90 in fired
    no_loss = SpikeDetector(warmup_steps=20)
    for s in range(31):
        ev = no_loss.update(s, 2.5 if s == 30 else 1.0, {"h.0": 1.0})
    assert ev and ev[0].signal == "global"  # without a loss there is no curve to follow: warmup_steps alone


def _heavy(rng):
    return math.exp(rng.gauss(0, 0.2) if rng.random() > 0.05 else rng.gauss(0, 0.8))


def _at_z(det, key, z):
    """The value whose plain z (no tail correction) is ``z`` on ``det``'s signal ``key``."""
    sig = det.signals[key]
    return math.exp(sig.forecast + z * math.sqrt(sig.var))


@pytest.mark.parametrize("moved,fires", [(6, True), (2, False)])
def test_the_broad_rule_reads_many_moved_layers_below_the_tail_corrected_bar(moved, fires):
    """``spikes.broad_z`` (default 5): the global norm fires at its plain z when at least ``broad_share`` of the layers
    pass ``broad_z`` too; a jump in two of eight layers (a rare token's embedding and head) stays under the tail bar."""
    rng = random.Random(5)
    names = [f"h.{i}" for i in range(8)]
    off, on = SpikeDetector(broad_z=None), SpikeDetector(broad_z=6.0, broad_share=0.5)
    for s in range(200):
        g, layers = _heavy(rng), {n: _heavy(rng) for n in names}
        assert not off.update(s, g, layers) and not on.update(s, g, layers)

    def at(key, z):
        return _at_z(on, key, z)

    assert on.signals["global"].tail_factor() > 1.05  # the default bar: 8 x the tail factor, above 8.4
    g = at("global", 7.5)
    layers = {n: at(n, 7.0 if i < moved else 0.0) for i, n in enumerate(names)}
    assert not any(e.signal == "global" for e in off.update(200, g, dict(layers)))
    events = on.update(200, g, dict(layers))
    assert any(e.signal == "global" for e in events) == fires
    if fires:
        ev = next(e for e in events if e.signal == "global")
        assert ev.z == pytest.approx(7.5) and ev.ratio > 1.5


def test_broad_z_is_validated():
    from gradloc_track.config import SpikeConfig

    with pytest.raises(ConfigError, match=r"spikes\.broad_z"):
        SpikeConfig(broad_z=0)
    with pytest.raises(ConfigError, match=r"spikes\.broad_share"):
        SpikeConfig(broad_share=1.5)


@pytest.mark.parametrize("last_fires", [False, True])
def test_the_broad_rule_gives_one_global_event_whichever_layer_comes_last(last_fires):
    """Review, stop 60: the rule read the last layer's verdict for the global one's, so a global spike came twice
    when the last layer was quiet, and a broad one was lost when the last layer fired on its own."""
    rng = random.Random(7)
    names = [f"h.{i}" for i in range(8)]
    det = SpikeDetector(broad_z=5.0, broad_share=0.5)
    for s in range(200):
        det.update(s, _heavy(rng), {n: _heavy(rng) for n in names})

    def at(key, z):
        return _at_z(det, key, z)

    layers = {n: at(n, 6.0) for n in names[:-1]}
    layers[names[-1]] = at(names[-1], 40.0 if last_fires else 0.0)  # the last layer: far over its bar, or quiet
    g = at("global", 6.5) if last_fires else at("global", 40.0)  # broad only / over the tail-corrected bar
    events = det.update(200, g, layers)
    assert [e.signal for e in events].count("global") == 1
    assert (names[-1] in [e.signal for e in events]) == last_fires
