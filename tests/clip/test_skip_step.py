"""SkipStepGuard: skip means skip (parameters and optimizer state unchanged), at no host sync.

Its modes make a non-finite step a bitwise no-op: the fused optimizers' own ``found_inf`` flag (no
sync, no memory), the one-bool ``sync`` read, the ``restore`` snapshot; beside GradScaler, with
Lightning-style closures, and on the first step (state created by the step)."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

from gradloc_track import GradMonitor, MemoryTracker
from gradloc_track.clip import AdaGC, GlobalClip, SkipStepGuard
from gradloc_track.clip.skip_fused import supports_found_inf
from gradloc_track.config import ConfigError

from ..monitor.test_packing import SyncSpy
from .helpers import assert_bitwise_equal, backward, mlp, snapshot

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
        SkipStepGuard(opt, clipper, mode="restore")
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


def test_clip_and_the_restoring_guard_add_no_host_sync():
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


FUSED = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.01, fused=True),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
    "adamw_amsgrad": lambda ps: torch.optim.AdamW(ps, lr=1e-2, amsgrad=True, fused=True),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01, fused=True),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1, fused=True),
}


def train(model, opt, clipper, seeds, nan_at=()):
    for s in seeds:
        backward(model, s, nan=s in nan_at)
        clipper.clip()
        opt.step()


@pytest.mark.parametrize("name", list(FUSED))
@pytest.mark.parametrize("bad_first", [False, True])
def test_fused_found_inf_skip_is_exact_and_sync_free(name, bad_first):
    model = mlp()
    opt = FUSED[name](model.parameters())
    clipper = GlobalClip(model, max_norm=0.5)
    guard = SkipStepGuard(opt, clipper)
    assert guard.mode == "fused" and clipper.skip_exact
    clean_model = copy.deepcopy(model)
    clean_opt, clean_clip = FUSED[name](clean_model.parameters()), GlobalClip(clean_model, max_norm=0.5)
    SkipStepGuard(clean_opt, clean_clip)  # the same path (the clip rides in the kernel's grad_scale)
    seeds = [99, 0, 1, 2] if bad_first else [0, 1, 99, 2]
    spy = SyncSpy()
    for s in seeds:
        backward(model, s, nan=s == 99)
        before = snapshot(model, opt)
        with spy if s == 99 and not bad_first else warnings.catch_warnings():
            clipper.clip()
            opt.step()
        if s == 99:  # first step: no state left behind either (fused SGD's first buffer is uninitialised)
            assert_bitwise_equal(snapshot(model, opt), before)
    assert spy.calls == []  # the skip itself reads nothing on the host
    train(clean_model, clean_opt, clean_clip, [s for s in seeds if s != 99])
    assert_bitwise_equal(snapshot(model, opt), snapshot(clean_model, clean_opt))  # as if never seen
    assert not hasattr(opt, "found_inf")  # attributes put back as they were


@pytest.mark.parametrize("mode", ["sync", "restore", "fused"])
def test_closure_inside_step_gets_the_fresh_flag(mode):
    """Lightning runs backward and the monitor inside optimizer.step(closure)."""
    model = mlp()
    fused = mode == "fused"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=fused)
    clipper = AdaGC(model, warmup_steps=1)
    SkipStepGuard(opt, clipper, mode=mode)
    clean_model = copy.deepcopy(model)
    clean_opt = torch.optim.AdamW(clean_model.parameters(), lr=1e-2, weight_decay=0.1, fused=fused)
    clean_clip = AdaGC(clean_model, warmup_steps=1)
    for s in (0, 1, 99, 2):
        def closure(s=s):
            backward(model, s, nan=s == 99)
            clipper.clip()
            return torch.tensor(float(s))

        assert opt.step(closure) == float(s)
    train(clean_model, clean_opt, clean_clip, [0, 1, 2])
    assert_bitwise_equal(snapshot(model, opt), snapshot(clean_model, clean_opt))


@pytest.mark.parametrize("mode", ["sync", "restore", "fused"])
def test_a_monitor_in_a_step_pre_hook_registered_first_gets_its_flag_used(mode):
    """watch() clips in an optimizer step pre-hook; the guard's hooks come after it."""
    model = mlp()
    fused = mode == "fused"
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=fused)
    clipper = GlobalClip(model, max_norm=0.5)
    opt.register_step_pre_hook(lambda *a: clipper.clip() and None)
    guard = SkipStepGuard(opt, clipper, mode=mode)
    clean_model = copy.deepcopy(model)
    clean_opt = torch.optim.SGD(clean_model.parameters(), lr=0.1, momentum=0.9, fused=fused)
    clean_clip = GlobalClip(clean_model, max_norm=0.5)
    SkipStepGuard(clean_opt, clean_clip, mode=mode)
    for s in (0, 99, 1, 2):
        backward(model, s, nan=s == 99)
        opt.step()
    train(clean_model, clean_opt, clean_clip, [0, 1, 2])
    assert_bitwise_equal(snapshot(model, opt), snapshot(clean_model, clean_opt))
    assert mode != "sync" or guard.skipped == 1


def test_grad_scaler_and_the_guard_combine_their_flags():
    """GradScaler sets its own found_inf for a fused optimizer: either flag skips the step, and the
    scaler's scale still backs off on its own overflow."""
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    clipper = GlobalClip(model, max_norm=0.5)
    SkipStepGuard(opt, clipper)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
    clean_model = copy.deepcopy(model)
    clean_opt = torch.optim.AdamW(clean_model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    clean_clip = GlobalClip(clean_model, max_norm=0.5)
    SkipStepGuard(clean_opt, clean_clip)
    for s in (0, 1, 99, 98, 2):
        g = torch.Generator().manual_seed(s)
        model.zero_grad(set_to_none=True)
        loss = model(torch.randn(5, 4, generator=g)).pow(2).mean()
        scaler.scale(loss * (1e38 if s == 98 else 1.0)).backward()  # 98: overflow only the scaler sees
        scaler.unscale_(opt)
        if s == 99:  # 99: a NaN only the clipper sees (after unscale_)
            model[0].weight.grad[0, 0] = float("nan")
        clipper.clip()
        scale = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        assert scaler.get_scale() == (scale / 2 if s == 98 else scale)  # the scaler acts on its own inf only
    assert not hasattr(opt, "found_inf") and not hasattr(opt, "grad_scale")
    train(clean_model, clean_opt, clean_clip, [0, 1, 2])
    assert_bitwise_equal(snapshot(model, opt), snapshot(clean_model, clean_opt))


def test_auto_picks_fused_only_when_every_group_is_fused():
    model = mlp()
    assert supports_found_inf(torch.optim.AdamW(model.parameters(), fused=True))
    assert not supports_found_inf(torch.optim.AdamW(model.parameters()))
    assert not supports_found_inf(torch.optim.RMSprop(model.parameters()))
    assert SkipStepGuard(torch.optim.AdamW(model.parameters()), AdaGC(model)).mode == "sync"
    with pytest.raises(ValueError, match="fused=True"):
        SkipStepGuard(torch.optim.AdamW(model.parameters()), AdaGC(model), mode="fused")


def test_a_bare_skip_clipper_warns_once_and_a_guard_silences_it():
    model = mlp()
    clipper = AdaGC(model, warmup_steps=1)
    with pytest.warns(UserWarning, match="SkipStepGuard"):
        backward(model, 0)
        clipper.clip()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        backward(model, 1)
        clipper.clip()  # once only
        bound = AdaGC(model)
        SkipStepGuard(torch.optim.SGD(model.parameters(), lr=0.1), bound)
        bound.clip()  # bound: the optimizer skips, nothing to say


def test_with_a_guard_a_bad_steps_gradients_are_left_alone():
    """The step does not use them: zeroing would be a wasted pass over every gradient."""
    model = mlp()
    clipper = GlobalClip(model, max_norm=1e6)
    guard = SkipStepGuard(torch.optim.SGD(model.parameters(), lr=0.1), clipper, mode="restore")
    backward(model, 0, nan=True)
    res = clipper.clip()
    assert res.nonfinite and torch.isnan(model[0].weight.grad).any()
    guard.remove()
    assert not clipper.skip_exact
    with pytest.warns(UserWarning, match="SkipStepGuard"):
        backward(model, 0, nan=True)
        clipper.clip()
    assert all(torch.isfinite(p.grad).all() and not p.grad.any() for p in model.parameters())  # zeroed


def _step_reads(mode: str | None, fused: bool, host_flag: bool = False) -> list[int]:
    """Host reads inside each opt.step() after the first, with the guard in ``mode`` (None: no guard)."""
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
    clipper = GlobalClip(model, max_norm=0.5)
    if mode:
        SkipStepGuard(opt, clipper, mode=mode)
    train(model, opt, clipper, [0])  # the first step creates the state
    spy, out = SyncSpy(), []
    for s in (1, 99, 2):
        backward(model, s, nan=s == 99)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            clipper.clip()
        if host_flag:  # the monitor moved its values to the host this step: the guard uses them
            clipper.last_nonfinite_host = s == 99
        with spy:
            opt.step()
        out.append(len(spy.calls))
        spy.calls.clear()
    return out


@pytest.mark.parametrize("mode,fused", [("fused", True), ("restore", False), ("sync", False)])
def test_host_reads_the_guard_adds_per_step(mode, fused):
    """fused and restore never read the flag on the host (after the first step, which may create
    state); sync reads it once per step, unless a caller already put it on the host. (AdamW on
    CPU reads its own step counters; that is counted in both runs.)"""
    base = _step_reads(None, fused)
    if mode != "sync":
        assert _step_reads(mode, fused) == base
        return
    # the skipped step (99) runs no optimizer at all: the guard's one read is all there is
    assert _step_reads(mode, fused) == [base[0] + 1, 1, base[2] + 1]
    assert _step_reads(mode, fused, host_flag=True) == [base[0], 0, base[2]]


@pytest.mark.parametrize("scheduler_first", [True, False])
def test_lr_schedulers_see_an_untouched_optimizer_step(scheduler_first):
    """The guard only adds hooks: a scheduler made before or after it neither warns nor breaks."""
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    clipper = GlobalClip(model)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5) if scheduler_first else None
    SkipStepGuard(opt, clipper, mode="sync")
    sched = sched or torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for s in (0, 99, 1):
            backward(model, s, nan=s == 99)
            clipper.clip()
            opt.step()
            sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2 / 8)
