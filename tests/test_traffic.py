"""Memory traffic over the gradients per step, pinned (issue 21): norms and clipping at the limit
the math sets. ``clip_grad_norm_(foreach=True)`` is 3.0 gradient sizes (norm read 1, scale
read+write 2); the monitor alone 1.0; the monitor and any clipper 3.0 on a non-logging step, with
non-finite values too; a logging step adds one read of the weights and nothing over the gradients.

The whole step with fused AdamW (issue 29): the kernel reads the gradients once, and writes them
back only when handed a ``grad_scale``. ``clip_grad_norm_`` + fused AdamW: 4.0; the monitor with a
single-coefficient clipper (its scale in the kernel): 3.0; with a per-tensor one: 4.0; alone: 2.0."""
from __future__ import annotations

import warnings

import pytest
import torch

from gradloc_track import GradMonitor, MemoryTracker
from gradloc_track.clip import AdaGC, GlobalClip, LayerClip, NoClip, SkipStepGuard, ZClip
from gradloc_track.traffic import TrafficCounter

CLIPPERS = {
    "GlobalClip": lambda m: GlobalClip(m, max_norm=0.1),
    "AdaGC": lambda m: AdaGC(m, warmup_steps=1),
    "AdaGC(mode=global)": lambda m: AdaGC(m, warmup_steps=1, mode="global"),
    "ZClip": lambda m: ZClip(m, warmup_steps=2),
    "LayerClip": lambda m: LayerClip(m, warmup_steps=2),
}


def mlp8():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(8)])


def backward(model, seed, nan=False):
    g = torch.Generator().manual_seed(seed)
    model.zero_grad(set_to_none=True)
    model(torch.randn(4, 32, generator=g)).pow(2).mean().backward()
    if nan:
        model[3].weight.grad[0, 0] = float("nan")


def traffic(model, fn) -> tuple[dict, dict]:
    """(gradient, weight) traffic of ``fn()`` in multiples of their sizes."""
    counter = TrafficCounter(grads=[p.grad for p in model.parameters()], weights=list(model.parameters()))
    with counter:
        fn()
    return counter.multiples("grads"), counter.multiples("weights")


def test_the_counter_reads_clip_grad_norm_as_three_gradient_sizes():
    model = mlp8()
    backward(model, 0)
    grads, weights = traffic(model, lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1, foreach=True))
    assert grads == {"read": 2.0, "write": 1.0, "total": 3.0} and weights["total"] == 0.0


def test_monitor_alone_reads_the_gradients_once_and_the_weights_on_logging_steps():
    model = mlp8()
    mon = GradMonitor(model, tracker=MemoryTracker(), log_every=2)
    backward(model, 0)
    assert traffic(model, lambda: mon.after_backward(1)) == ({"read": 1.0, "write": 0.0, "total": 1.0},
                                                             {"read": 0.0, "write": 0.0, "total": 0.0})
    assert traffic(model, lambda: mon.after_backward(2)) == ({"read": 1.0, "write": 0.0, "total": 1.0},
                                                             {"read": 1.0, "write": 0.0, "total": 1.0})


@pytest.mark.parametrize("nan", [False, True])
@pytest.mark.parametrize("name", list(CLIPPERS))
def test_monitor_and_clipper_make_one_norm_pass_and_one_scale_pass(name, nan):
    model = mlp8()
    clipper = CLIPPERS[name](model)
    SkipStepGuard(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), clipper)  # the optimizer skips
    mon = GradMonitor(model, tracker=MemoryTracker(), clipper=clipper, log_every=4)
    for step in range(3):  # past every warm-up
        backward(model, step)
        mon.after_backward(step)
    backward(model, 3, nan=nan)
    grads, weights = traffic(model, lambda: mon.after_backward(3))
    assert grads == {"read": 2.0, "write": 1.0, "total": 3.0} and weights["total"] == 0.0
    backward(model, 4, nan=nan)
    grads, weights = traffic(model, lambda: mon.after_backward(4))  # logging: + the weight norms
    assert grads["total"] == 3.0 and weights == {"read": 1.0, "write": 0.0, "total": 1.0}


def test_noclip_with_a_guard_touches_no_gradient():
    model = mlp8()
    clipper = NoClip(model)
    SkipStepGuard(torch.optim.SGD(model.parameters(), lr=0.1), clipper)
    mon = GradMonitor(model, tracker=MemoryTracker(), clipper=clipper, log_every=4)
    backward(model, 1, nan=True)
    assert traffic(model, lambda: mon.after_backward(1))[0] == {"read": 1.0, "write": 0.0, "total": 1.0}


@pytest.mark.parametrize("on_nonfinite,guarded,expected", [("skip", False, 5.0), ("zero", True, 5.0),
                                                           ("raise", False, 3.0)])
def test_zeroing_non_finite_values_is_the_one_extra_pass(on_nonfinite, guarded, expected):
    """Only where the optimizer would use a bad step's gradients are they zeroed (one more
    read+write of integer views): skip with no guard, and zero (which keeps training on the rest)."""
    model = mlp8()
    clipper = AdaGC(model, warmup_steps=1, on_nonfinite=on_nonfinite)
    if guarded:
        SkipStepGuard(torch.optim.SGD(model.parameters(), lr=0.1), clipper)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the unguarded skip's one-time advice
        backward(model, 0)
        clipper.clip()
        backward(model, 1)
        grads, _ = traffic(model, clipper.clip)
    assert grads["total"] == expected


def test_a_fused_kernel_writes_the_gradients_only_with_a_grad_scale():
    model = mlp8()
    backward(model, 0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    opt.step()  # the state exists
    for scale, expected in ((None, {"read": 1.0, "write": 0.0, "total": 1.0}),
                            (torch.tensor(2.0), {"read": 1.0, "write": 1.0, "total": 2.0})):
        if scale is not None:
            opt.grad_scale = scale
        assert traffic(model, opt.step)[0] == expected


WHOLE_STEP = [("clip_grad_norm_", 4.0), ("alone", 2.0), ("GlobalClip", 3.0), ("AdaGC(mode=global)", 3.0),
              ("ZClip", 3.0), ("AdaGC", 4.0), ("LayerClip", 4.0)]


@pytest.mark.parametrize("name,expected", WHOLE_STEP)
def test_the_whole_step_with_fused_adamw(name, expected):
    """The call and ``optimizer.step()`` together, non-logging, over the gradients (the weights: the
    kernel's read+write, 2.0, in every row)."""
    model = mlp8()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
    if name == "clip_grad_norm_":
        def step(s):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1, foreach=True)
            opt.step()
    else:
        clipper = CLIPPERS[name](model) if name in CLIPPERS else None
        mon = GradMonitor(model, tracker=MemoryTracker(), clipper=clipper, optimizer=opt, log_every=100)

        def step(s):
            mon.after_backward(s)
            opt.step()
    for s in range(3):  # past every warm-up
        backward(model, s)
        step(s + 1)
    backward(model, 3)
    grads, weights = traffic(model, lambda: step(4))
    assert grads["total"] == expected and weights == {"read": 1.0, "write": 1.0, "total": 2.0}


def lm_backward(model, seed: int) -> None:
    """A language-model step watch()'s capture sees (its forward), so the detector is armed."""
    g = torch.Generator().manual_seed(seed)
    batch = torch.randint(0, 64, (2, 17), generator=g)
    model.zero_grad(set_to_none=True)
    logits = model(batch[:, :-1])
    torch.nn.functional.cross_entropy(logits.reshape(-1, 64), batch[:, 1:].reshape(-1)).backward()


@pytest.mark.parametrize("fused,whole", [(True, 3.0), (False, 6.0)])
def test_watch_with_every_default_reads_the_gradients_once_in_its_hook(tiny_gpt, fused, whole):
    """Issue 38: ``watch(clip="global")`` with every default (detector armed, the update signal on, the
    optimizer's state as in training) reads the gradients once in its hook: the update signal is measured
    after the optimizer's step from its state, not by a second read (``<m, g>``). The whole step with fused
    AdamW: 3.0 (the kernel's read and write-back of its grad_scale); with foreach AdamW 6.0, as
    ``clip_grad_norm_`` + foreach (it was 4.0 and 7.0)."""
    import gradloc_track

    opt = torch.optim.AdamW(tiny_gpt.parameters(), lr=1e-3, weight_decay=0.1, fused=fused, foreach=not fused)
    handle = gradloc_track.watch(tiny_gpt, opt, tracker=MemoryTracker(), log_every=2, locate=False, clip="global")
    adam = handle.monitor.detector_inputs.adam
    assert adam is not None and handle.monitor.detector is not None
    for s in range(5):  # the optimizer's state, the update's moments and every warm-up in place
        lm_backward(tiny_gpt, s)
        opt.step()
    lm_backward(tiny_gpt, 5)
    assert traffic(tiny_gpt, opt.step)[0]["total"] == whole  # non-logging step 5, the hook inside
    assert adam._pending is not None and adam._pending[0] == adam.optimizer_steps - 1  # its update, measured
    seen = handle.monitor.detector.signals["@update"].n
    lm_backward(tiny_gpt, 6)
    hook = traffic(tiny_gpt, lambda: handle.step(7))[0]  # the hook alone (the clip in place without a kernel)
    one_read = {"read": 1.0, "write": 0.0, "total": 1.0} if fused else {"read": 2.0, "write": 1.0, "total": 3.0}
    assert hook == one_read
    assert handle.monitor.detector.signals["@update"].n == seen + 1  # the detector read step 5's update
    opt.step()
    lm_backward(tiny_gpt, 8)
    next(tiny_gpt.parameters()).grad.view(-1)[0] = float("nan")  # a non-finite step: the guard skips it
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt.step()
    lm_backward(tiny_gpt, 9)
    assert traffic(tiny_gpt, lambda: handle.step(11))[0] == one_read  # the state after it is read, not <m, g>
    handle.finish()
