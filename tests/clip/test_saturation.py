"""Clipping that has turned into a learning-rate cut is reported (issue 22): the running clipped
fraction and mean coefficient after warm-up, a warning on a saturated stream and not on a
healthy one. (The monitor's warning: tests/monitor/test_clip_feedback.py; the console line:
tests/demo/test_console.py.)"""
from __future__ import annotations

import math
import warnings

import pytest
import torch

from gradloc_track.clip import AdaGC, GlobalClip
from gradloc_track.clip.saturation import saturation_line, saturation_warning

from .helpers import feed, tanh_mlp


def test_a_saturated_adagc_is_reported_and_a_healthy_one_is_not():
    # the demo's story: warm-up norms below the later ones, AdaGC's threshold follows at ~0.04%/step
    sat_model, ok_model = tanh_mlp(), tanh_mlp()
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
    assert saturation_line("adagc", ok).startswith("clip=adagc after its warm-up: ")
    # a fixed threshold has no warm-up: its line says it counts every step (held-out tester round 3: "after
    # warm-up" beside a sweep table over the settled steps read as two answers to one question)
    assert saturation_line("global", ok).startswith("clip=global over every step (no warm-up: the start-up "
                                                   "transient included): ")


def test_a_short_stretch_does_not_warn_and_global_clip_counts_its_coefficient():
    model = tanh_mlp()
    clipper = GlobalClip(model, max_norm=0.5)
    feed(clipper, model, 40, lambda t: 1.0)
    s = clipper.saturation
    assert saturation_warning("global", s.steps, *s.values().tolist()) is None  # 40 steps: shorter than the window
    summary = s.summary()
    assert summary["clipped_fraction"] == 1.0 and summary["mean_coef"] == pytest.approx(0.5, rel=0.25)


def test_a_skipped_step_does_not_count_as_clipped_to_zero():
    model = tanh_mlp()
    clipper = GlobalClip(model, max_norm=100.0)
    feed(clipper, model, 5, lambda t: 1.0)
    for p in model.parameters():
        p.grad = torch.full_like(p, math.nan)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        clipper.clip()
    assert clipper.saturation.summary() == {"steps": 6, "clipped_fraction": 0.0, "mean_coef": 1.0}
