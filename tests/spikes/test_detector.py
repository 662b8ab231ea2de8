"""Spike detector and spike score against independent references."""
from __future__ import annotations

import math
import random

import pytest
import torch

from gradloc_track.config import ConfigError
from gradloc_track.spikes import SpikeDetector, spike_score


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
    assert det.metrics()["spike/count"] == 0


def test_no_events_during_warmup():
    det = SpikeDetector(warmup_steps=10)
    for step in range(10):
        assert det.update(step, 1.0 if step < 9 else 100.0) == []
    assert det.update(10, 100.0 * 10)  # after warm-up the same kind of jump fires


def test_ema_statistics_match_the_equations():
    det = SpikeDetector(warmup_steps=4, alpha=0.9, z_thresh=50, ratio_thresh=50)
    xs = [1.0, 2.0, 1.5, 1.2, 1.4, 1.9, 1.1, 1.3]
    for s, x in enumerate(xs):
        det.update(s, x)
    logs = [math.log(x) for x in xs]
    w = logs[:4]
    mean = sum(w) / 4
    var = sum((x - mean) ** 2 for x in w) / 4
    for x in logs[4:]:
        d = x - mean
        mean = mean + 0.1 * d
        var = 0.9 * (var + 0.1 * d * d)
    sig = det.signals["global"]
    assert sig.mean == pytest.approx(mean) and sig.var == pytest.approx(var)
    det.update(8, 5.0)
    z = (math.log(5.0) - mean) / math.sqrt(var)
    assert det.metrics()["spike/z/global"] == pytest.approx(z, rel=1e-6)
    assert det.metrics()["spike/ratio/global"] == pytest.approx(5.0 / math.exp(mean), rel=1e-6)


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


def brute_force_score(values, window=128, n_sigma=6.0, min_history=16):
    spikes = seen = 0
    for i, v in enumerate(values):
        prev = values[max(0, i - window):i]
        if len(prev) < min_history:
            continue
        seen += 1
        mean = sum(prev) / len(prev)
        std = (sum((p - mean) ** 2 for p in prev) / len(prev)) ** 0.5
        spikes += v > mean + n_sigma * std
    return spikes / seen


def test_spike_score_matches_brute_force():
    rng = random.Random(1)
    values = [1 + rng.random() * 0.1 for _ in range(400)]
    for i in (150, 151, 300):
        values[i] = 5.0
    assert spike_score(values) == pytest.approx(brute_force_score(values))
    assert spike_score(values) > 0


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


def test_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="spikes.alpha"):
        SpikeDetector(alpha=1.0)
    with pytest.raises(ConfigError, match="spikes.per_token_threshold"):
        SpikeDetector(mode="fixed")
