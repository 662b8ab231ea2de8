"""Degenerate steps never poison a clipper (issue 17): a zero-gradient step (an all-masked batch,
``loss * 0``) or a layer without gradient during warm-up must not scale later gradients to 0."""
from __future__ import annotations

import math

import pytest
import torch

from gradloc_track.clip import AdaGC, LayerClip, ZClip


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))


def global_norm(model) -> float:
    return math.sqrt(sum(p.grad.double().norm().item() ** 2 for p in model.parameters() if p.grad is not None))


@pytest.mark.parametrize("mode", ["tensor", "shard", "global"])
def test_adagc_zero_gradient_step_in_warmup_does_not_zero_training(mode):
    """0.2: global norm 2.56 -> 0 ... 1.62 -> 0 for every step after warm-up."""
    model = mlp()
    clipper = AdaGC(model, warmup_steps=5, mode=mode)
    g = torch.Generator().manual_seed(0)
    post = []
    for t in range(12):
        model.zero_grad()
        (model(torch.randn(8, 6, generator=g)).pow(2).mean() * (0.0 if t == 2 else 1.0)).backward()
        pre = global_norm(model)
        res = clipper.clip()
        post.append(global_norm(model))
        if t == 2:
            assert pre == 0.0 and post[-1] == 0.0  # the step itself: nothing to scale
    assert min(post[5:]) > 0.1  # was exactly 0 after warm-up
    assert torch.isfinite(res.threshold_t).all() and (res.threshold_t > 0).all()


def test_adagc_zero_gradient_tensor_is_treated_like_a_missing_one():
    model = mlp()
    clipper = AdaGC(model, warmup_steps=0, beta=0.9)
    g = torch.Generator().manual_seed(1)
    for t in range(5):
        model.zero_grad()
        model(torch.randn(8, 6, generator=g)).pow(2).mean().backward()
        if t == 4:
            model[0].weight.grad.zero_()  # one tensor all zeros (a masked slice, a dead unit)
            gamma = clipper.gamma.clone()
        clipper.clip()
    assert clipper.gamma[0] == gamma[0]  # untouched, as for a missing gradient (no beta decay towards 0)
    assert not torch.equal(clipper.gamma[1:], gamma[1:])


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


@pytest.mark.parametrize("cls", [ZClip, LayerClip])
def test_zero_norm_steps_do_not_enter_the_statistics(cls):
    """A run with two all-zero steps (one in warm-up) ends with the statistics of the run without them."""
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(8, 6, generator=g) for _ in range(14)]
    runs = []
    for zero_steps in ((), (1, 8)):
        model = mlp()
        clipper = cls(model, warmup_steps=4)
        for t, x in enumerate(xs):
            for z in ([0.0] if t in zero_steps else []) + [1.0]:  # the zero step comes in addition
                model.zero_grad()
                (model(x).pow(2).mean() * z).backward()
                clipper.clip()
        runs.append(clipper.stats)
    assert torch.equal(runs[0].mean, runs[1].mean) and torch.equal(runs[0].var, runs[1].var)
    assert (runs[1].mean > 0).all()
