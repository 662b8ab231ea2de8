"""AdaGC against a plain-python port of the official rules (lishuai-97/AdaGC, megatron-gpt2.patch),
written from the published description, on randomized streams with missing gradients."""
from __future__ import annotations

import copy
import math
import random

import pytest
import torch

from gradloc_track.clip import AdaGC

from .helpers import global_norm, small_model


def model4():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))


def stream_with_gaps(model, steps, seed, late=(0,), flaky=(1,), p_missing=0.1):
    """Per step a list of gradients (None = no gradient): ``late`` tensors have none for the first
    50 steps, ``flaky`` ones miss ``p_missing`` of the steps; spikes of 5-50x on 5% of the steps."""
    gen = torch.Generator().manual_seed(seed)
    rnd = random.Random(seed)
    out = []
    for t in range(steps):
        spike = rnd.random() < 0.05
        grads = []
        for i, p in enumerate(model.parameters()):
            g = torch.randn(p.shape, generator=gen) * (0.1 + 0.3 * i) * (rnd.uniform(5, 50) if spike else 1.0)
            if (i in late and t < 50) or (i in flaky and rnd.random() < p_missing):
                g = None
            grads.append(g)
        out.append(grads)
    return out


def official_adagc(stream, lambda_rel, beta, warmup, lambda_abs, eps, mode):
    """The official procedure in python floats. Returns per step (thresholds, coefs) by tensor index
    (present tensors only; ``mode="global"``: key -1 holds the single threshold/coef)."""
    state: dict[int, float] = {}
    out = []
    for t, grads in enumerate(stream):
        norms = {i: g.double().norm().item() for i, g in enumerate(grads) if g is not None}
        total = math.sqrt(sum(n * n for n in norms.values()))
        if t < warmup:  # global clipping; running minimum of the post-clip norm from first appearance
            c = lambda_abs / (total + eps)
            c = c if c < 1.0 else 1.0
            if mode == "global":
                v = min(total, lambda_abs)
                state[-1] = v if -1 not in state else min(state[-1], v)
            else:
                for i, n in norms.items():
                    state[i] = n * c if i not in state else min(state[i], n * c)
            out.append(({i: lambda_abs for i in norms}, {i: c for i in norms}))
            continue
        if mode == "global":
            state.setdefault(-1, total)
            avg = state[-1]
            thr = lambda_rel * avg
            c, eff = (thr / (total + eps), thr) if total > thr else (1.0, total)
            state[-1] = avg * beta + eff * (1 - beta)
            out.append(({i: thr for i in norms}, {i: c for i in norms}))
            continue
        thrs, coefs = {}, {}
        for i, n in norms.items():
            state.setdefault(i, n)  # first appearance after warm-up
            avg = state[i]
            thr = lambda_rel * avg
            c, eff = (thr / (n + eps), thr) if n > thr else (1.0, n)
            state[i] = avg * beta + eff * (1 - beta)
            thrs[i], coefs[i] = thr, c
        out.append((thrs, coefs))
    return out


def set_grads(model, grads):
    for p, g in zip(model.parameters(), grads):
        p.grad = None if g is None else g.clone()


@pytest.mark.parametrize("mode", ["tensor", "shard", "global"])
@pytest.mark.parametrize("warmup,seed", [(0, 1), (5, 2), (60, 3)])
def test_adagc_equals_the_official_rule_with_missing_gradients(mode, warmup, seed):
    model = model4()
    stream = stream_with_gaps(model, 90, seed)
    ref = official_adagc(stream, 1.04, 0.9, warmup, 1.0, 1e-6, mode)
    clipper = AdaGC(model, lambda_rel=1.04, beta=0.9, warmup_steps=warmup, lambda_abs=1.0, eps=1e-6, mode=mode)
    names = clipper.names
    for t, grads in enumerate(stream):
        set_grads(model, grads)
        res = clipper.clip()
        thr, coefs = ref[t]
        got_thr, got_coef = res.thresholds, res.coefs
        for i, g in enumerate(grads):
            if g is None:
                assert list(model.parameters())[i].grad is None
                continue
            assert got_thr[names[i]] == pytest.approx(thr[i], rel=1e-5), (t, i)
            assert got_coef[names[i]] == pytest.approx(coefs[i], rel=1e-5), (t, i)
            torch.testing.assert_close(list(model.parameters())[i].grad.double(), g.double() * coefs[i],
                                       rtol=1e-5, atol=1e-9)
    # the tensor without gradients for 50 steps trains normally afterwards: never zeroed
    late = list(model.parameters())[0]
    assert late.grad is not None and late.grad.norm() > 0


def test_a_step_without_gradient_leaves_the_state_untouched():
    model = model4()
    clipper = AdaGC(model, warmup_steps=2, beta=0.9)
    stream = stream_with_gaps(model, 6, seed=5, late=(), flaky=())
    for grads in stream[:4]:
        set_grads(model, grads)
        clipper.clip()
    gamma = clipper.gamma.clone()
    grads = list(stream[4])
    grads[1] = None
    set_grads(model, grads)
    clipper.clip()
    assert clipper.gamma[1] == gamma[1]  # no beta decay for the missing tensor
    assert not torch.equal(clipper.gamma[0], gamma[0])


def test_no_clipping_inside_the_eps_band():
    model = torch.nn.Linear(1, 1, bias=False)
    clipper = AdaGC(model, lambda_rel=1.04, warmup_steps=0, eps=1e-3)
    model.weight.grad = torch.tensor([[1.0]])
    clipper.clip()  # gamma = 1
    model.weight.grad = torch.tensor([[1.04]])  # n == thr: the official code leaves it alone
    res = clipper.clip()
    assert res.coefs["weight"] == 1.0 and model.weight.grad.item() == torch.tensor(1.04).item()


@pytest.mark.parametrize("mode", ["tensor", "global"])
def test_resume_is_bit_exact(mode):
    model = model4()
    stream = stream_with_gaps(model, 70, seed=7)
    full = AdaGC(model, warmup_steps=3, mode=mode)
    outs = []
    for grads in stream:
        set_grads(model, grads)
        full.clip()
        outs.append([None if p.grad is None else p.grad.clone() for p in model.parameters()])
    first = AdaGC(model, warmup_steps=3, mode=mode)
    for grads in stream[:40]:
        set_grads(model, grads)
        first.clip()
    resumed = AdaGC(model, warmup_steps=3, mode=mode)
    resumed.load_state_dict(copy.deepcopy(first.state_dict()))
    for t, grads in enumerate(stream[40:], start=40):
        set_grads(model, grads)
        resumed.clip()
        for p, ref in zip(model.parameters(), outs[t]):
            assert (p.grad is None and ref is None) or torch.equal(p.grad, ref)


def test_mode_mismatch_on_resume_names_the_fix():
    from gradloc_track.config import ConfigError

    state = AdaGC(model4(), mode="global").state_dict()
    with pytest.raises(ConfigError, match="mode='global'"):
        AdaGC(model4()).load_state_dict(state)


@pytest.mark.parametrize("mode", ["tensor", "shard", "global"])
def test_adagc_zero_gradient_step_in_warmup_does_not_zero_training(mode):
    """0.2: global norm 2.56 -> 0 ... 1.62 -> 0 for every step after warm-up."""
    model = small_model()
    clipper = AdaGC(model, warmup_steps=5, mode=mode)
    g = torch.Generator().manual_seed(0)
    post = []
    for t in range(12):
        model.zero_grad()
        (model(torch.randn(8, 6, generator=g)).pow(2).mean() * (0.0 if t == 2 else 1.0)).backward()
        pre = global_norm(model)
        res = clipper.clip()
        post.append(global_norm(model))
        if t == 2:
            assert pre == 0.0 and post[-1] == 0.0  # the step itself: nothing to scale
    assert min(post[5:]) > 0.1  # was exactly 0 after warm-up
    assert torch.isfinite(res.threshold_t).all() and (res.threshold_t > 0).all()


def test_adagc_zero_gradient_tensor_is_treated_like_a_missing_one():
    model = small_model()
    clipper = AdaGC(model, warmup_steps=0, beta=0.9)
    g = torch.Generator().manual_seed(1)
    for t in range(5):
        model.zero_grad()
        model(torch.randn(8, 6, generator=g)).pow(2).mean().backward()
        if t == 4:
            model[0].weight.grad.zero_()  # one tensor all zeros (a masked slice, a dead unit)
            gamma = clipper.gamma.clone()
        clipper.clip()
    assert clipper.gamma[0] == gamma[0]  # untouched, as for a missing gradient (no beta decay towards 0)
    assert not torch.equal(clipper.gamma[1:], gamma[1:])


def test_a_state_saved_under_ddp_with_module_names_still_loads():
    """Names saved before DDP's ``module.`` was dropped load into the bare names; other names still refuse."""
    state = AdaGC(model4()).state_dict()
    state["names"] = [f"module.{n}" for n in state["names"]]
    AdaGC(model4()).load_state_dict(state)
    state["names"] = [f"other.{n}" for n in state["names"]]
    with pytest.raises(ValueError, match="parameter names differ"):
        AdaGC(model4()).load_state_dict(state)
