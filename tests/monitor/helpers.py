"""A backward pass on a real model and the plain float64 per-parameter loop the monitor is checked against."""
from __future__ import annotations

import math

import torch

from gradloc_track.grouping import layer_of


def backward(model, seed=0, B=2, T=16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 64, (B, T), generator=g)
    model.zero_grad(set_to_none=True)
    model(x).float().logsumexp(-1).mean().backward()


def reference(model, mode="block", patterns=None):
    """Plain loop in float64: one norm per parameter, layers summed by hand."""
    per = {n: p.grad.double().norm().item() for n, p in model.named_parameters()}
    layers: dict[str, float] = {}
    for n, v in per.items():
        lay = layer_of(n, mode, patterns)
        layers[lay] = layers.get(lay, 0.0) + v * v
    return per, {k: math.sqrt(v) for k, v in layers.items()}


def weight_layers(model, mode="block"):
    w: dict[str, float] = {}
    for n, p in model.named_parameters():
        w[layer_of(n, mode)] = w.get(layer_of(n, mode), 0.0) + p.double().norm().item() ** 2
    return {k: math.sqrt(v) for k, v in w.items()}
