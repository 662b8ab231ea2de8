"""Per-layer clip metrics against the norms measured before and after clipping; the thresholds
they show are the ones in force, on a readable scale (issue 22)."""
from __future__ import annotations

import math

import pytest
import torch

from gradloc_track import GradMonitor, MemoryTracker
from gradloc_track.clip import AdaGC, ZClip

from .helpers import tanh_mlp


def test_clip_metrics_per_layer(tiny_gpt):
    from gradloc_track.clip.metrics import clip_metrics
    from gradloc_track.grouping import LayerGrouping

    clipper = AdaGC(tiny_gpt, warmup_steps=1)
    g = torch.Generator().manual_seed(0)
    for t in range(3):
        for p in tiny_gpt.parameters():
            p.grad = torch.randn(p.shape, generator=g) * (10.0 if t == 2 else 1.0)
        pre = {n: p.grad.norm().item() for n, p in tiny_gpt.named_parameters()}
        res = clipper.clip()
    post = {n: p.grad.norm().item() for n, p in tiny_gpt.named_parameters()}
    grouping = LayerGrouping.build(clipper.names)
    m = {k: v.item() for k, v in clip_metrics(res, grouping).items()}
    thr = res.thresholds
    for lay, members in grouping.members().items():
        ref_coef = math.sqrt(sum(post[n] ** 2 for n in members) / sum(pre[n] ** 2 for n in members))
        assert m[f"clip/coef/{lay}"] == pytest.approx(ref_coef, rel=1e-5)
        assert m[f"clip/threshold/{lay}"] == pytest.approx(math.sqrt(sum(thr[n] ** 2 for n in members)), rel=1e-5)
    assert m["clip/total_norm_pre"] == pytest.approx(math.sqrt(sum(v * v for v in pre.values())), rel=1e-5)
    assert m["clip/total_norm_post"] == pytest.approx(math.sqrt(sum(v * v for v in post.values())), rel=1e-5)
    assert m["clip/clipped_fraction"] == pytest.approx(sum(c < 1 for c in res.coefs.values()) / len(pre))


@pytest.mark.parametrize("policy", ["skip", "zero"])
def test_a_non_finite_layer_reads_coefficient_0_like_the_norm_after(tiny_gpt, policy):
    """A NaN loss: every gradient non-finite, the step skipped (or zeroed). The layers read coefficient 1
    ("untouched") beside a post-clip norm of 0 (held-out tester round 8); now 0, as what was applied. A layer
    without a gradient on a finite step stays 1."""
    from gradloc_track.clip import GlobalClip
    from gradloc_track.clip.metrics import clip_metrics
    from gradloc_track.grouping import LayerGrouping

    clipper = GlobalClip(tiny_gpt, 1.0, on_nonfinite=policy)
    grouping = LayerGrouping.build(clipper.names)
    for p in tiny_gpt.parameters():
        p.grad = torch.full(p.shape, float("nan"))
    m = {k: v.item() for k, v in clip_metrics(clipper.clip(), grouping).items()}
    assert m["clip/total_norm_post"] == 0.0
    assert {m[f"clip/coef/{lay}"] for lay in grouping.layers} == {0.0}
    names = dict(tiny_gpt.named_parameters())
    unused = grouping.layers[-1]
    for n, p in names.items():
        p.grad = None if n in grouping.members()[unused] else torch.ones(p.shape) * 1e-3
    m = {k: v.item() for k, v in clip_metrics(clipper.clip(), grouping).items()}
    assert m[f"clip/coef/{unused}"] == 1.0 and m["clip/total_norm_post"] > 0


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
    model = tanh_mlp()
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
    model = tanh_mlp()
    rows = logged_thresholds(ZClip(model, warmup_steps=3), model, 5)
    assert ["clip/threshold/global" in m for m, _ in rows] == [False, False, False, True, True]
