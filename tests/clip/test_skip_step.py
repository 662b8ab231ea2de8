"""SkipStepGuard: skip means skip (parameters and optimizer state unchanged), at no host sync."""
from __future__ import annotations

import copy

import pytest
import torch

from gradloc_track import GradMonitor, MemoryTracker
from gradloc_track.clip import AdaGC, GlobalClip, SkipStepGuard
from gradloc_track.config import ConfigError

from ..monitor.test_packing import SyncSpy
from .helpers import backward, mlp


def snapshot(model, opt):
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


OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01),
}


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("mode", ["restore", "sync"])
def test_skip_means_skip_parameters_and_optimizer_state_unchanged(opt_name, mode):
    model = mlp()
    opt = OPTIMIZERS[opt_name](model.parameters())
    clipper = AdaGC(model, warmup_steps=2)  # on_nonfinite="skip" by default
    SkipStepGuard(opt, clipper, mode=mode)
    clean = copy.deepcopy((model, opt))  # a run that never sees the bad step
    clean_clip = AdaGC(clean[0], warmup_steps=2)
    for step in range(3):
        for m, o, c in ((model, opt, clipper), (clean[0], clean[1], clean_clip)):
            backward(m, step)
            c.clip()
            o.step()
    before = snapshot(model, opt)
    backward(model, 99, nan=True)
    assert clipper.clip().nonfinite
    opt.step()
    assert_bitwise_equal(snapshot(model, opt), before)
    for step in range(3, 5):  # afterwards training goes on exactly as if the step never happened
        for m, o, c in ((model, opt, clipper), (clean[0], clean[1], clean_clip)):
            backward(m, step)
            c.clip()
            o.step()
    assert_bitwise_equal(snapshot(model, opt), snapshot(*clean))


def test_without_the_guard_adamw_moves_on_a_zeroed_step():
    """The reason for the guard: zeroed gradients do not stop AdamW (moments, weight decay)."""
    model = mlp()
    opt = OPTIMIZERS["adamw"](model.parameters())
    clipper = AdaGC(model, warmup_steps=2)
    for step in range(3):
        backward(model, step)
        clipper.clip()
        opt.step()
    before = [p.detach().clone() for p in model.parameters()]
    backward(model, 99, nan=True)
    clipper.clip()
    opt.step()
    assert max((p - b).abs().max().item() for p, b in zip(model.parameters(), before)) > 1e-4


def test_guard_from_a_monitor_skips_a_first_step_that_would_create_the_state():
    model = mlp()
    opt = OPTIMIZERS["adamw"](model.parameters())
    mon = GradMonitor(model, tracker=MemoryTracker(), clipper=GlobalClip(model), log_every=1)
    guard = SkipStepGuard(opt, mon)
    before = snapshot(model, opt)
    backward(model, 0, nan=True)
    mon.after_backward(0)
    opt.step()
    assert_bitwise_equal(snapshot(model, opt), before)
    assert opt.state_dict()["state"] == {}
    backward(model, 1)
    mon.after_backward(1)
    opt.step()
    assert opt.state_dict()["state"] and not torch.equal(model[0].weight, before[0][0])
    guard.remove()
    assert not opt._optimizer_step_pre_hooks and not opt._optimizer_step_post_hooks


def count_syncs(guarded: bool) -> list[str]:
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    clipper = AdaGC(model, warmup_steps=1)
    if guarded:
        SkipStepGuard(opt, clipper)
    backward(model, 0)
    clipper.clip()
    opt.step()  # creates the state (the guard may read the flag once here)
    spy = SyncSpy()
    for step in range(1, 4):
        backward(model, step, nan=step == 2)
        with spy:
            clipper.clip()
            opt.step()
    return spy.calls


def test_clip_and_the_guard_add_no_host_sync():
    # AdamW reads its CPU step counter itself (capturable=False); clip() and the guard add nothing
    assert count_syncs(guarded=True) == count_syncs(guarded=False)
    model = mlp()
    clipper = AdaGC(model, warmup_steps=1)
    spy = SyncSpy()
    for step in range(3):
        backward(model, step, nan=step == 1)
        with spy:
            clipper.clip()
    assert spy.calls == []


def test_guard_rejects_what_it_cannot_read():
    with pytest.raises(TypeError, match="clipper"):
        SkipStepGuard(torch.optim.SGD(mlp().parameters(), lr=0.1), flag=3)
    with pytest.raises(ConfigError, match="mode"):
        SkipStepGuard(torch.optim.SGD(mlp().parameters(), lr=0.1), flag=lambda: None, mode="later")
