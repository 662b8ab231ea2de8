"""LayerClip: per-layer clipping of the exploding layer only, and the threshold it logs."""
from __future__ import annotations

import math

import pytest
import torch

from gradloc_track import GradMonitor, MemoryTracker
from gradloc_track.clip import LayerClip


def test_layerclip_clips_the_exploding_layer_only(tiny_gpt):
    clipper = LayerClip(tiny_gpt, z_thresh=3.0, alpha=0.9, warmup_steps=5)
    g = torch.Generator().manual_seed(0)
    params = dict(tiny_gpt.named_parameters())
    for t in range(12):
        for p in params.values():
            p.grad = torch.randn(p.shape, generator=g) * 0.01
        if t == 11:  # h.1 explodes while the global norm is dominated by everything else
            for n, p in params.items():
                if n.startswith("h.1."):
                    p.grad *= 30
        before = {n: p.grad.norm().item() for n, p in params.items()}
        res = clipper.clip()
    coefs = res.coefs
    for n, p in params.items():
        if n.startswith("h.1."):
            assert coefs[n] < 0.2 and p.grad.norm().item() < before[n] * 0.2
        else:
            assert coefs[n] == 1.0 and p.grad.norm().item() == pytest.approx(before[n])


def test_layerclip_logs_the_threshold_it_applies(tiny_gpt):
    clipper = LayerClip(tiny_gpt, z_thresh=2.0, alpha=0.9, warmup_steps=4)
    tracker = MemoryTracker()
    mon = GradMonitor(tiny_gpt, tracker=tracker, clipper=clipper, log_every=1)
    g = torch.Generator().manual_seed(0)
    for step in range(6):
        for n, p in tiny_gpt.named_parameters():
            p.grad = torch.randn(p.shape, generator=g) * (40.0 if step == 5 and n.startswith("h.1.") else 1.0)
        mon.after_backward(step)
    layer_after = math.sqrt(sum(p.grad.norm().item() ** 2 for n, p in tiny_gpt.named_parameters()
                                if n.startswith("h.1.")))
    logged = dict(tracker.metrics[-1][1])["clip/threshold/h.1"]
    assert logged == pytest.approx(layer_after, rel=1e-4)  # was sqrt(#tensors) too large


def test_layerclip_layer_without_gradient_in_warmup_is_not_zeroed_forever():
    """0.2: the layer that first gets a gradient after warm-up went 0.607 -> 0 for every step."""
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"a": torch.nn.Linear(4, 4), "b": torch.nn.Linear(4, 4)})
    clipper = LayerClip(model, warmup_steps=5)
    g = torch.Generator().manual_seed(0)
    ratios = []
    for t in range(16):
        model.zero_grad(set_to_none=True)
        x = torch.randn(8, 4, generator=g)
        (model["a"](x) + (model["b"](x) if t >= 6 else 0)).pow(2).mean().backward()
        pre = None if model["b"].weight.grad is None else model["b"].weight.grad.norm().item()
        clipper.clip()
        if pre is not None:
            ratios.append(model["b"].weight.grad.norm().item() / pre)
    # the late layer warms up on its own first gradients (no clipping meanwhile), then is clipped
    # only like any layer: never scaled to 0
    assert min(ratios) > 0.1, ratios
    assert ratios[:5] == [1.0] * 5
