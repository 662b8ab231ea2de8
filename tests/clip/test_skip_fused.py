"""A single-coefficient clip rides in a fused optimizer's kernel (``grad_scale``): the clip makes no
pass of its own, the step equals ``clip_grad_norm_`` + the same optimizer within float tolerance
(the kernel divides by ``1/coef``), per-tensor clippers keep their own pass, ``GradScaler``'s scale
is multiplied in, and a clip whose step never came is forgotten (issue 29 item 1)."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

from gradloc_track.clip import AdaGC, GlobalClip, LayerClip, SkipStepGuard, ZClip
from gradloc_track.traffic import TrafficCounter

from .helpers import backward, mlp

FUSED = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=0.01, fused=True),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, fused=True),
    "adamw_amsgrad": lambda ps: torch.optim.AdamW(ps, lr=1e-2, amsgrad=True, fused=True),
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01, fused=True),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1, fused=True),
}
MAX_NORM = 0.05  # below every step's norm: each step is clipped


def assert_params_close(a, b):
    for x, y in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(x, y, rtol=2e-6, atol=1e-8)


@pytest.mark.parametrize("name", list(FUSED))
def test_global_clip_in_the_kernel_equals_clip_grad_norm_within_float_tolerance(name):
    model, ref = mlp(), mlp()
    opt, ref_opt = FUSED[name](model.parameters()), FUSED[name](ref.parameters())
    clipper = GlobalClip(model, max_norm=MAX_NORM)
    assert SkipStepGuard(opt, clipper).mode == "fused" and clipper.grad_scale is not None
    for s in range(2):
        backward(model, s)
        backward(ref, s)
        raw = [p.grad.clone() for p in model.parameters()]
        res = clipper.clip()
        assert res.deferred and all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), raw))  # untouched
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM, foreach=True)
        assert float(res.total_norm_pre_t) == pytest.approx(float(norm), rel=1e-6)
        assert float(res.total_norm_post_t) == pytest.approx(MAX_NORM, rel=1e-5)  # what the kernel applies
        opt.step()
        ref_opt.step()
        for p, q in zip(model.parameters(), ref.parameters()):  # the kernel wrote the clipped gradient back
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-9)
        assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")
    assert_params_close(model, ref)


@pytest.mark.parametrize("make,deferred", [
    (lambda m: ZClip(m, warmup_steps=2, max_grad_norm=MAX_NORM), [True] * 4),
    (lambda m: AdaGC(m, warmup_steps=2, mode="global"), [True] * 4),
    (lambda m: AdaGC(m, warmup_steps=2), [True, True, False, False]),  # per tensor after its warm-up
    (lambda m: LayerClip(m, warmup_steps=2), [True, True, False, False]),  # one per layer after warm-up
])
def test_only_single_coefficients_ride_in_the_kernel_and_the_step_matches_the_clippers_own_pass(make, deferred):
    model = mlp()
    twin = copy.deepcopy(model)
    opt, twin_opt = FUSED["adamw"](model.parameters()), FUSED["adamw"](twin.parameters())
    clipper, own = make(model), make(twin)
    SkipStepGuard(opt, clipper)
    SkipStepGuard(twin_opt, own, mode="sync")  # the same optimizer, the clipper's own multiply
    got = []
    for s in range(4):
        backward(model, s)
        backward(twin, s)
        got.append(clipper.clip().deferred)
        assert not own.clip().deferred
        opt.step()
        twin_opt.step()
    assert got == deferred
    assert_params_close(model, twin)


def test_the_clip_makes_no_pass_over_the_gradients_when_the_kernel_applies_it():
    model = mlp()
    clipper = GlobalClip(model, max_norm=MAX_NORM)
    SkipStepGuard(FUSED["adamw"](model.parameters()), clipper)
    backward(model, 0)
    counter = TrafficCounter(grads=[p.grad for p in model.parameters()])
    with counter:
        clipper.clip()
    assert counter.multiples("grads") == {"read": 1.0, "write": 0.0, "total": 1.0}  # its norm read, no scale pass


def closure_run(model, opt, clipper, seeds) -> list[bool]:
    """Lightning's order: backward and the clip inside ``step(closure)``; whether each clip was deferred."""
    deferred = []
    for s in seeds:
        def closure(s=s):
            backward(model, s, nan=s == 99)
            deferred.append(clipper.clip().deferred)
            return torch.tensor(float(s))

        opt.step(closure)
    return deferred


def test_a_clip_inside_step_is_promised_from_its_warm_up_state():
    """Lightning clips inside ``step(closure)``, after the guard's pre-hook: the pre-hook tells the
    kernel a scale is coming only while AdaGC's next clip is a single (warm-up) coefficient."""
    model = mlp()
    twin = copy.deepcopy(model)
    opt, twin_opt = FUSED["adamw"](model.parameters()), FUSED["adamw"](twin.parameters())
    clipper, own = AdaGC(model, warmup_steps=2, lambda_abs=0.05), AdaGC(twin, warmup_steps=2, lambda_abs=0.05)
    SkipStepGuard(opt, clipper)
    SkipStepGuard(twin_opt, own, mode="sync")
    assert closure_run(model, opt, clipper, [0, 1, 99, 2, 3]) == [True, True, False, False, False]
    assert closure_run(twin, twin_opt, own, [0, 1, 99, 2, 3]) == [False] * 5
    assert_params_close(model, twin)


def test_grad_scalers_scale_is_multiplied_in():
    """Without ``unscale_`` GradScaler hands the kernel its scale; the clip's goes on top (the product)."""
    runs = []
    for mode in ("auto", "sync"):
        model = mlp()
        opt = FUSED["adamw"](model.parameters())
        clipper = GlobalClip(model, max_norm=MAX_NORM * 256)  # the gradients it sees carry the scaler's 256
        SkipStepGuard(opt, clipper, mode=mode)
        scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
        for s in range(3):
            g = torch.Generator().manual_seed(s)
            model.zero_grad(set_to_none=True)
            scaler.scale(model(torch.randn(5, 4, generator=g)).pow(2).mean()).backward()
            assert clipper.clip().deferred == (mode == "auto")
            scaler.step(opt)
            scaler.update()
        assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")
        runs.append(model)
    assert_params_close(*runs)


def test_a_clip_whose_step_never_came_is_forgotten():
    model, ref = mlp(), mlp()
    opt, ref_opt = FUSED["adamw"](model.parameters()), FUSED["adamw"](ref.parameters())
    clipper, ref_clip = GlobalClip(model, max_norm=MAX_NORM), GlobalClip(ref, max_norm=MAX_NORM)
    SkipStepGuard(opt, clipper)
    SkipStepGuard(ref_opt, ref_clip)
    backward(model, 99, nan=True)
    clipper.clip()  # a NaN step the loop then dropped (no opt.step())
    for m, o, c in ((model, opt, clipper), (ref, ref_opt, ref_clip)):
        backward(m, 0)
        c.clip()
        o.step()
    assert float(clipper.grad_scale) == 1.0 and float(clipper.found_inf) == 0.0
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))


def test_the_kernel_scales_only_when_it_would_scale_exactly_the_clippers_gradients():
    model = mlp()
    extra = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.AdamW([{"params": list(model.parameters())}, {"params": [extra]}], lr=1e-2, fused=True)
    clipper = GlobalClip(model, max_norm=MAX_NORM)
    SkipStepGuard(opt, clipper)
    assert clipper.grad_scale is None  # the kernel would clip ``extra`` too: the clipper scales itself
    backward(model, 0)
    assert not clipper.clip().deferred
    model2 = mlp()
    opt2 = FUSED["adamw"](model2.parameters())
    clipper2 = GlobalClip(model2, max_norm=MAX_NORM)
    SkipStepGuard(opt2, clipper2)
    opt2.add_param_group({"params": [torch.nn.Parameter(torch.ones(3))]})
    for s, deferred in ((0, True), (1, False)):  # a group added: seen after the next step
        backward(model2, s)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert clipper2.clip().deferred == deferred
        opt2.step()
