"""snapshot: localization leaves no trace: gradients (the same objects), buffers, RNG, modes and
requires_grad flags come back exactly."""
from __future__ import annotations

import torch

from gradloc_track.localizer.snapshot import Snapshot

from .helpers import B, T, LM, data, sum_loss


def test_everything_a_probe_touches_comes_back_bitwise():
    model = LM(batchnorm=True)
    x, y, w, _ = data()
    loss_fn = sum_loss(model, x, y, w)
    loss_fn(torch.ones(B, T)).backward()
    model.head.bias.grad = None  # a None gradient stays None
    grads = {n: p.grad for n, p in model.named_parameters()}
    values = {n: None if g is None else g.clone() for n, g in grads.items()}
    running = model.bn.running_mean.clone()
    tracked = model.bn.num_batches_tracked.clone()
    rng = torch.get_rng_state()

    snap = Snapshot(model)
    model.eval()
    model.mid.weight.requires_grad_(False)
    for p in model.parameters():  # what a probe does: fresh gradients, a forward that moves BatchNorm
        p.grad = None
    model.train()
    loss_fn(torch.ones(B, T) * 0.5).backward()
    torch.rand(10)
    snap.restore()

    for n, p in model.named_parameters():
        assert p.grad is grads[n]
        assert (p.grad is None) == (values[n] is None) and (p.grad is None or torch.equal(p.grad, values[n]))
    assert torch.equal(model.bn.running_mean, running) and torch.equal(model.bn.num_batches_tracked, tracked)
    assert torch.equal(torch.get_rng_state(), rng)
    assert model.training and model.mid.weight.requires_grad


def test_copy_grads_protects_storage_written_in_place_and_grads_for_maps_params():
    model = LM()
    x, y, w, _ = data()
    sum_loss(model, x, y, w)(torch.ones(B, T)).backward()
    before = model.head.weight.grad.clone()
    snap = Snapshot(model, copy_grads=True)
    model.head.weight.grad.mul_(3.0)  # a bucket view written in place
    snap.restore()
    assert torch.equal(model.head.weight.grad, before)
    params = [model.head.weight, torch.nn.Parameter(torch.zeros(1))]
    got = snap.grads_for(params)
    assert torch.equal(got[0], before) and got[1] is None
    model.zero_grad(set_to_none=True)
    assert Snapshot(model).grads_for(list(model.parameters())) is None
