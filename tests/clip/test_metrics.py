"""Per-layer clip metrics against the norms measured before and after clipping."""
from __future__ import annotations

import math

import pytest
import torch

from gradloc_track.clip import AdaGC


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
