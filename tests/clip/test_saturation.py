"""Clipping that has turned into a learning-rate cut is reported (issue 22): the running clipped
fraction and mean coefficient after warm-up, a warning on a saturated stream and not on a
healthy one; and the thresholds the metrics show are the ones in force, on a readable scale."""
from __future__ import annotations

import math
import random
import warnings

import pytest
import torch

from gradloc_track import GradMonitor, MemoryTracker
from gradloc_track.clip import AdaGC, GlobalClip, ZClip
from gradloc_track.clip.saturation import saturation_line, saturation_warning


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))


def feed(clipper, model, steps, scale_of, seed=0):
    """Gradients of random direction whose global norm is ``scale_of(t)`` (times log-normal noise)."""
    gen = torch.Generator().manual_seed(seed)
    rnd = random.Random(seed)
    params = list(model.parameters())
    for t in range(steps):
        grads = [torch.randn(p.shape, generator=gen) for p in params]
        total = math.sqrt(sum(g.pow(2).sum().item() for g in grads))
        s = scale_of(t) * math.exp(rnd.gauss(0, 0.2)) / total
        for p, g in zip(params, grads):
            p.grad = g * s
        clipper.clip()


def test_a_saturated_adagc_is_reported_and_a_healthy_one_is_not():
    # the demo's story: warm-up norms below the later ones, AdaGC's threshold follows at ~0.04%/step
    sat_model, ok_model = mlp(), mlp()
    saturated, healthy = AdaGC(sat_model, warmup_steps=20), AdaGC(ok_model, warmup_steps=20)
    feed(saturated, sat_model, 220, lambda t: 0.25 if t < 20 else 1.0)
    feed(healthy, ok_model, 220, lambda t: 1.0)
    sat, ok = saturated.saturation.summary(), healthy.saturation.summary()
    assert sat["steps"] == ok["steps"] == 200  # counted after warm-up only
    assert sat["clipped_fraction"] > 0.95 and sat["mean_coef"] < 0.4
    # AdaGC scales even a stationary stream (its running norm starts at the warm-up's minimum and
    # grows by at most 0.04% a step): ~99% of steps, by ~0.74. Shown by the metrics, not a warning
    assert ok["clipped_fraction"] > 0.9 and 0.6 < ok["mean_coef"] < 0.9
    sat_ema, ok_ema = saturated.saturation.values().tolist(), healthy.saturation.values().tolist()
    msg = saturation_warning("adagc", saturated.saturation.steps, *sat_ema)
    assert msg is not None and "clip.lambda_rel" in msg and "clip.beta" in msg and "learning-rate cut" in msg
    assert saturation_warning("adagc", healthy.saturation.steps, *ok_ema) is None
    assert "learning-rate cut" in saturation_line("adagc", sat)
    assert "learning-rate cut" not in saturation_line("adagc", ok)


def test_a_short_stretch_does_not_warn_and_global_clip_counts_its_coefficient():
    model = mlp()
    clipper = GlobalClip(model, max_norm=0.5)
    feed(clipper, model, 40, lambda t: 1.0)
    s = clipper.saturation
    assert saturation_warning("global", s.steps, *s.values().tolist()) is None  # 40 steps: shorter than the window
    summary = s.summary()
    assert summary["clipped_fraction"] == 1.0 and summary["mean_coef"] == pytest.approx(0.5, rel=0.25)


def test_a_skipped_step_does_not_count_as_clipped_to_zero():
    model = mlp()
    clipper = GlobalClip(model, max_norm=100.0)
    feed(clipper, model, 5, lambda t: 1.0)
    for p in model.parameters():
        p.grad = torch.full_like(p, math.nan)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        clipper.clip()
    assert clipper.saturation.summary() == {"steps": 6, "clipped_fraction": 0.0, "mean_coef": 1.0}


def logged_thresholds(clipper, model, steps, scale=1.0):
    tracker = MemoryTracker()
    mon = GradMonitor(model, tracker=tracker, clipper=clipper, log_every=1)
    gen = torch.Generator().manual_seed(0)
    norms = []
    for step in range(steps):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen) * scale
        norms.append(mon.after_backward(step).layer_norms)
    return [(dict(m), n) for (_, m), n in zip(tracker.metrics, norms)]


def test_adagc_warmup_thresholds_are_the_global_clip_in_force_on_the_layers_scale():
    """0.2: sqrt(#tensors) x lambda_abs per layer in warm-up (3.46 for a block), 0.02-0.05 after."""
    model = mlp()
    rows = logged_thresholds(AdaGC(model, warmup_steps=3, lambda_abs=1.0), model, 6, scale=0.1)
    for step, (m, layers) in enumerate(rows):
        total = math.sqrt(sum(v * v for v in layers.values()))
        for lay, norm in layers.items():
            thr = m[f"clip/threshold/{lay}"]
            if step < 3:  # the global clip, as each layer's share of it
                assert m["clip/threshold/global"] == 1.0
                assert thr == pytest.approx(norm / total, rel=1e-5)
            assert 0.3 * norm < thr < 3 * norm  # on the layer's own scale, warm-up and after
    assert all(v == v and v != -1.0 for m, _ in rows for k, v in m.items() if k.startswith("clip/threshold/"))


def test_no_threshold_in_force_is_left_out_rather_than_drawn_as_minus_one():
    model = mlp()
    rows = logged_thresholds(ZClip(model, warmup_steps=3), model, 5)
    assert ["clip/threshold/global" in m for m, _ in rows] == [False, False, False, True, True]


def monitored(scale_of, steps=90):
    """AdaGC behind a monitor (logging every 10th step), gradients whose norm follows ``scale_of``."""
    model = mlp()
    clipper = AdaGC(model, warmup_steps=20)
    mon = GradMonitor(model, tracker=MemoryTracker(), clipper=clipper, optimizer=torch.optim.SGD(
        model.parameters(), lr=0.1), log_every=10)
    step = [0]

    class Stepper:
        def clip(self):
            mon.after_backward(step[0])
            step[0] += 1

    feed(Stepper(), model, steps, scale_of)
    return clipper


def test_the_monitor_warns_once_on_a_saturated_stream_and_never_on_a_healthy_one():
    with pytest.warns(UserWarning, match="learning-rate cut") as caught:
        monitored(lambda t: 0.25 if t < 20 else 1.0)
    assert sum("learning-rate cut" in str(w.message) for w in caught) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        monitored(lambda t: 1.0)


def test_the_console_summary_reports_the_clip_after_warmup():
    from gradloc_track.demo.console import summary_lines

    base = {"seconds": 1.0, "final_loss": 2.0, "max_post_clip_grad_norm": 0.2}
    sat = {**base, "clip_steps_after_warmup": 80.0, "clip_clipped_fraction": 1.0, "clip_mean_coef": 0.29}
    ok = {**base, "clip_steps_after_warmup": 80.0, "clip_clipped_fraction": 0.3, "clip_mean_coef": 0.9}
    lines = summary_lines(130, "adagc", sat, [100], {}, "/tmp/run")
    assert "clip=adagc after warm-up: 100% of 80 steps clipped, mean coefficient 0.29 — a 3.4x learning-rate cut, " \
           "not a spike guard" in lines
    assert "clip=adagc after warm-up: 30% of 80 steps clipped, mean coefficient 0.90" in summary_lines(
        130, "adagc", ok, [], {}, "/tmp/run")
