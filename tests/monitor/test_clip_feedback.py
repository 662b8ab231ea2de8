"""The monitor installs a SkipStepGuard when it knows the optimizer (``monitor.clip_feedback``):
skip is exact by default; ``clip.skip_step="off"`` keeps 0.2's zeroing and says nothing. It
also warns, once, when clipping has turned into a learning-rate cut (issue 22)."""
from __future__ import annotations

import warnings

import pytest
import torch

from gradloc_track import GradMonitor, MemoryTracker
from gradloc_track.clip import AdaGC, GlobalClip

from ..clip.helpers import assert_bitwise_equal, backward, feed, mlp, snapshot, tanh_mlp

MONITOR_OPTIMIZERS = {
    "adamw": (lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1), "sync"),
    "adamw_fused": (lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True), "fused"),
    "sgd_momentum": (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01), "sync"),
}


@pytest.mark.parametrize("name", list(MONITOR_OPTIMIZERS))
def test_skip_is_exact_by_default_when_the_monitor_knows_the_optimizer(name):
    """0.2: GradMonitor(optimizer=AdamW, clipper=GlobalClip(on_nonfinite="skip")) still moved the
    weights on a NaN step (decay, moments); only an explicit SkipStepGuard made it exact."""
    make, mode = MONITOR_OPTIMIZERS[name]
    runs = []
    for seeds in ((0, 1, 99, 2, 3), (0, 1, 2, 3)):  # the second run never sees the bad step
        model = mlp()
        opt = make(model.parameters())
        mon = GradMonitor(model, tracker=MemoryTracker(), clipper=GlobalClip(model, max_norm=0.5), optimizer=opt,
                          log_every=2)
        assert mon.skip_guard.mode == mode
        for step, seed in enumerate(seeds):
            backward(model, seed, nan=seed == 99)
            before = snapshot(model, opt)
            mon.after_backward(step)
            opt.step()
            if seed == 99:
                assert_bitwise_equal(snapshot(model, opt), before)
        runs.append(snapshot(model, opt))
    assert_bitwise_equal(*runs)


def test_skip_step_off_keeps_the_zeroing_and_says_nothing():
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    clipper = GlobalClip(model, skip_step="off")
    mon = GradMonitor(model, tracker=MemoryTracker(), clipper=clipper, optimizer=opt)
    assert mon.skip_guard is None
    backward(model, 0)
    mon.after_backward(0)
    opt.step()
    before = [p.detach().clone() for p in model.parameters()]
    backward(model, 99, nan=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the user chose it: no advice
        mon.after_backward(1)
    assert all(not p.grad.any() for p in model.parameters())  # zeroed, as in 0.2
    opt.step()
    assert max((p - b).abs().max().item() for p, b in zip(model.parameters(), before)) > 1e-4  # AdamW moves


def monitored(scale_of, steps=90):
    """AdaGC behind a monitor (logging every 10th step), gradients whose norm follows ``scale_of``."""
    model = tanh_mlp()
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
