"""The monitor installs a SkipStepGuard when it knows the optimizer (``monitor.clip_feedback``):
skip is exact by default; ``clip.skip_step="off"`` keeps 0.2's zeroing and says nothing. It
also warns, once, when clipping has turned into a learning-rate cut (issue 22)."""
from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch

from gradloc_track import GradMonitor, MemoryTracker
from gradloc_track.clip import AdaGC, GlobalClip
from gradloc_track.clip.handoff import NonfiniteFlag

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


# -- a skip guard whenever the optimizer is known, clipper or not (issue 28 item 1) -----------------
BAD_TOKEN, NAN_STEP = 63, 4  # a token whose embedding turns NaN; the step whose batch carries it


def nan_at_bad_token(module, args, out):
    """The model's own fault: any sample holding BAD_TOKEN makes the loss (and gradient) NaN."""
    return out * torch.where(args[0] == BAD_TOKEN, float("inf"), 1.0).unsqueeze(-1)


def nanogpt_steps(handle_args: dict, fused: bool, steps: int = 7):
    """A nanoGPT loop with ``watch(model, opt, **handle_args)``: (state before/after the NaN step, losses, warnings,
    handle)."""
    import gradloc_track

    from ..integrations.conftest import counting_batch
    from ..integrations.nanogpt import tiny_gpt

    model = tiny_gpt()
    model.transformer.wte.register_forward_hook(nan_at_bad_token)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=fused)
    tracker = MemoryTracker()
    handle = gradloc_track.watch(model, opt, tracker=tracker, log_every=100, **handle_args)
    losses, states = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(steps):
            ids = counting_batch(step)["input_ids"]
            ids = ids.masked_fill(ids == BAD_TOKEN, 0)
            if step == NAN_STEP:
                ids[2, 5] = BAD_TOKEN
            _, loss = model(ids[:, :-1].contiguous(), ids[:, 1:].contiguous())
            losses.append(loss.item())
            loss.backward()
            if step == NAN_STEP:
                states.append(copy.deepcopy(snapshot(model, opt)))
            opt.step()
            opt.zero_grad(set_to_none=True)
            if step == NAN_STEP:
                states.append(snapshot(model, opt))
    return states, losses, [str(w.message) for w in caught], tracker, handle


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("clip", [None, "global", "zclip", "adagc"])
def test_a_nan_step_through_watch_leaves_adamw_bitwise_unchanged_clipper_or_not(clip, fused):
    """0.3: ``watch(model, opt)`` with no ``clip=`` installed no guard: AdamW took the NaN, every later
    loss was NaN and each step warned "localizing the spike ... failed: FloatingPointError"."""
    (before, after), losses, said, tracker, handle = nanogpt_steps({"clip": clip} if clip else {}, fused)
    assert handle.monitor.skip_guard.mode == ("fused" if fused else "sync")
    assert_bitwise_equal(after, before)  # parameters and every optimizer state tensor
    assert math.isnan(losses[NAN_STEP]) and all(math.isfinite(v) for i, v in enumerate(losses) if i != NAN_STEP)
    assert sum("FloatingPointError" in m for m in said) <= 1  # the NaN step itself, once
    assert dict(tracker.series("grad_norm/nonfinite"))[NAN_STEP] > 0  # recorded on the spike's own step
    assert NAN_STEP in [s.step for s in handle.spikes]


def test_without_a_clipper_the_monitor_sets_the_flag_from_its_own_norms():
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    mon = GradMonitor(model, tracker=MemoryTracker(), optimizer=opt, log_every=2)
    guard = mon.skip_guard
    assert guard.mode == "sync" and isinstance(guard.clipper, NonfiniteFlag)
    backward(model, 0)
    mon.after_backward(1)
    assert guard.clipper.last_nonfinite_host is None and not bool(guard.clipper.last_nonfinite)  # no transfer
    opt.step()
    backward(model, 99, nan=True)
    mon.after_backward(2)  # a logging step: the flag rides in its one transfer
    assert guard.clipper.last_nonfinite_host is True
    before = snapshot(model, opt)
    opt.step()
    assert_bitwise_equal(snapshot(model, opt), before) and guard.skipped == 1


def test_a_clipper_that_handles_non_finite_steps_itself_gets_no_guard():
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    assert GradMonitor(model, clipper=GlobalClip(model, on_nonfinite="zero"), optimizer=opt).skip_guard is None
    assert GradMonitor(model, clipper=GlobalClip(model, on_nonfinite="raise"), optimizer=opt).skip_guard is None
    assert GradMonitor(model).skip_guard is None  # no optimizer, nothing to guard


def test_clip_none_can_still_opt_out_of_the_skip():
    """``clip=none clip.skip_step=off`` (or another ``on_nonfinite``) builds a measuring NoClip that
    handles the step as asked: no guard, 0.2's zeroing."""
    from gradloc_track.clip import NoClip, build_clipper
    from gradloc_track.config import NoClipConfig

    model = mlp()
    assert build_clipper(NoClipConfig(), model) is None
    off = build_clipper(NoClipConfig(skip_step="off"), model)
    assert isinstance(off, NoClip) and off.skip_step == "off"
    assert GradMonitor(model, clipper=off, optimizer=torch.optim.AdamW(model.parameters())).skip_guard is None
    assert build_clipper(NoClipConfig(on_nonfinite="raise"), model).on_nonfinite == "raise"


def test_a_user_clipper_without_a_flag_gets_the_monitors():
    """A ``ClipperLike`` of the user's with ``on_nonfinite="skip"`` that keeps no flag of its own."""

    class Halve:
        kind, names, on_nonfinite = "halve", None, "skip"

        def clip(self, sq_norms=None):
            for p in model.parameters():
                p.grad.mul_(0.5)

    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    mon = GradMonitor(model, clipper=Halve(), optimizer=opt)
    assert isinstance(mon.skip_guard.clipper, NonfiniteFlag)
    backward(model, 99, nan=True)
    mon.after_backward(1)
    before = snapshot(model, opt)
    opt.step()
    assert_bitwise_equal(snapshot(model, opt), before)
