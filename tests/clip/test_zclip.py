"""ZClip against the installed ``zclip`` package (bluorion-com/ZClip), every mode and option,
with the package's own defaults (max_grad_norm=1.0) and with skip_update_on_spike=True."""
from __future__ import annotations

import random

import pytest
import torch

from gradloc_track.clip import ZClip

zclip_pkg = pytest.importorskip("zclip")


def small_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))


def stream(model, steps, seed, base):
    """Gradients whose global norm wanders around ``base`` with 2-30x spikes on ~10% of steps."""
    gen = torch.Generator().manual_seed(seed)
    rnd = random.Random(seed)
    out = []
    for _ in range(steps):
        s = base * rnd.uniform(0.7, 1.3) * (rnd.uniform(2, 30) if rnd.random() < 0.1 else 1.0)
        out.append([torch.randn(p.shape, generator=gen) * s / 4 for p in model.parameters()])
    return out


def set_grads(model, grads):
    for p, g in zip(model.parameters(), grads):
        p.grad = g.clone()


OPTIONS = [("zscore", "adaptive_scaling", 1.0), ("zscore", "adaptive_scaling", 0.8), ("zscore", "mean", 1.0),
           ("percentile", "adaptive_scaling", 1.0)]


@pytest.mark.parametrize("mode,option,factor", OPTIONS)
@pytest.mark.parametrize("max_grad_norm,skip", [(1.0, False), (1.0, True), (None, False), (None, True)])
def test_zclip_equals_the_package(mode, option, factor, max_grad_norm, skip):
    ours_model, ref_model = small_model(), small_model()
    grads_stream = stream(ours_model, 60, seed=sum(map(ord, f"{mode}{option}{factor}{max_grad_norm}{skip}")),
                          base=0.8 if max_grad_norm else 3.0)  # around the package's 1.0 cap
    pkg_kwargs = {"alpha": 0.9, "z_thresh": 2.0, "warmup_steps": 6, "mode": mode, "clip_option": option,
                  "clip_factor": factor, "skip_update_on_spike": skip}
    if max_grad_norm is None:
        pkg_kwargs["max_grad_norm"] = None
        ours = ZClip(ours_model, **pkg_kwargs)
    else:  # the package's own default: 1.0; ours must be told
        ours = ZClip(ours_model, max_grad_norm=1.0, **pkg_kwargs)
    ref = zclip_pkg.ZClip(**pkg_kwargs)
    clipped_steps = 0
    for grads in grads_stream:
        set_grads(ours_model, grads)
        set_grads(ref_model, grads)
        res = ours.clip()
        total = ref.step(ref_model)
        assert res.total_norm == pytest.approx(total, rel=1e-5)
        for p, q in zip(ours_model.parameters(), ref_model.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)
        clipped_steps += res.total_norm_post < res.total_norm * (1 - 1e-4)
    assert clipped_steps >= 3  # the stream exercised the clipping path
    assert ours.mean.item() == pytest.approx(ref.mean, rel=1e-5)
    assert ours.var.item() == pytest.approx(ref.var, rel=1e-4)


def test_default_has_no_fixed_cap_in_warmup():
    model = small_model()
    z = ZClip(model, warmup_steps=3)
    for p in model.parameters():
        p.grad = torch.full_like(p, 10.0)
    before = [p.grad.clone() for p in model.parameters()]
    z.clip()
    assert all(torch.equal(p.grad, b) for p, b in zip(model.parameters(), before))
