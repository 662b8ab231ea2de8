"""Small models and gradient streams shared by the clipper tests."""
from __future__ import annotations

import copy
import math
import random

import torch


def small_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))


def global_norm(model) -> float:
    return math.sqrt(sum(p.grad.double().norm().item() ** 2 for p in model.parameters() if p.grad is not None))


def grad_stream(model, steps, spike_at=(), seed=0):
    """Per step, a list of gradient tensors (one per parameter); spikes scale one step by 50x."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for t in range(steps):
        scale = 50.0 if t in spike_at else 1.0
        out.append([torch.randn(p.shape, generator=g) * scale * (0.5 + i) for i, p in enumerate(model.parameters())])
    return out


def set_grads(model, grads):
    for p, gr in zip(model.parameters(), grads):
        p.grad = gr.clone()


def mlp(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)).to(dtype)


def backward(model, seed, nan=False):
    g = torch.Generator().manual_seed(seed)
    dtype = next(model.parameters()).dtype
    model.zero_grad(set_to_none=True)
    model(torch.randn(5, 4, generator=g).to(dtype)).pow(2).mean().backward()
    if nan:
        model[0].weight.grad[0, 0] = float("nan")


def snapshot(model, opt):
    """Parameters and optimizer state, copied (to compare bitwise after a skipped step)."""
    return [p.detach().clone() for p in model.parameters()], copy.deepcopy(opt.state_dict()["state"])


def assert_bitwise_equal(a, b):
    (pa, sa), (pb, sb) = a, b
    assert all(torch.equal(x, y) for x, y in zip(pa, pb))
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].keys() == sb[k].keys()
        for name, v in sa[k].items():
            w = sb[k][name]
            assert torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w, (k, name)


def tanh_mlp():
    """The saturation tests' model (8 -> 8 -> 4)."""
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
