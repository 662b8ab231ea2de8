"""Clippers against independent references: the paper's equations in a plain loop, the zclip
package, and torch's clip_grad_norm_."""
from __future__ import annotations

import copy
import math

import pytest
import torch

from gradloc_track.clip import AdaGC, GlobalClip, LayerClip, ZClip
from gradloc_track.config import ConfigError


def small_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))


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


def test_global_clip_matches_torch():
    a, b = small_model(), small_model()
    for grads in grad_stream(a, 5, spike_at=(2,)):
        set_grads(a, grads)
        set_grads(b, grads)
        res = GlobalClip(a, max_norm=1.5).clip()
        total = torch.nn.utils.clip_grad_norm_(b.parameters(), 1.5, foreach=True)
        assert res.total_norm == pytest.approx(total.item(), rel=1e-6)
        for p, q in zip(a.parameters(), b.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-8)


def test_layerclip_clips_the_exploding_layer_only(tiny_gpt):
    clipper = LayerClip(tiny_gpt, z_thresh=3.0, alpha=0.9, warmup_steps=5)
    g = torch.Generator().manual_seed(0)
    params = dict(tiny_gpt.named_parameters())
    for t in range(12):
        for p in params.values():
            p.grad = torch.randn(p.shape, generator=g) * 0.01
        if t == 11:  # h.1 explodes while the global norm is dominated by everything else
            for n, p in params.items():
                if n.startswith("h.1."):
                    p.grad *= 30
        before = {n: p.grad.norm().item() for n, p in params.items()}
        res = clipper.clip()
    coefs = res.coefs
    for n, p in params.items():
        if n.startswith("h.1."):
            assert coefs[n] < 0.2 and p.grad.norm().item() < before[n] * 0.2
        else:
            assert coefs[n] == 1.0 and p.grad.norm().item() == pytest.approx(before[n])


@pytest.mark.parametrize("mode", ["skip", "zero", "raise"])
def test_nonfinite_gradients(mode):
    model = small_model()
    clipper = AdaGC(model, warmup_steps=2, on_nonfinite=mode)
    stream = grad_stream(model, 4)
    for grads in stream[:3]:
        set_grads(model, grads)
        clipper.clip()
    gamma = clipper.gamma.clone()
    bad = [g.clone() for g in stream[3]]
    bad[0][0, 0] = float("nan")
    set_grads(model, bad)
    if mode == "raise":
        with pytest.raises(FloatingPointError, match=r"0\.weight"):
            clipper.clip()
        return
    res = clipper.clip()
    assert res.nonfinite
    grads = [p.grad for p in model.parameters()]
    assert all(torch.isfinite(g).all() for g in grads)
    assert torch.count_nonzero(grads[0]) == 0
    if mode == "skip":
        assert all(torch.count_nonzero(g) == 0 for g in grads)
        torch.testing.assert_close(clipper.gamma, gamma)  # nothing entered the EMA
    else:
        assert all(torch.count_nonzero(g) > 0 for g in grads[1:])
        assert clipper.gamma[0] == gamma[0] and not torch.equal(clipper.gamma[1:], gamma[1:])


@pytest.mark.parametrize("cls,kwargs", [(AdaGC, {"warmup_steps": 3}), (ZClip, {"warmup_steps": 3}),
                                        (LayerClip, {"warmup_steps": 3})])
def test_resume_clips_exactly_as_the_uninterrupted_run(cls, kwargs):
    model = small_model()
    stream = grad_stream(model, 16, spike_at=(9,))
    full = cls(model, **kwargs)
    outs = []
    for grads in stream:
        set_grads(model, grads)
        full.clip()
        outs.append([p.grad.clone() for p in model.parameters()])
    first = cls(model, **kwargs)
    for grads in stream[:7]:
        set_grads(model, grads)
        first.clip()
    saved = copy.deepcopy(first.state_dict())
    resumed = cls(small_model(), **kwargs)
    resumed.load_state_dict(saved)
    resumed.params = list(model.parameters())
    for t, grads in enumerate(stream[7:], start=7):
        set_grads(model, grads)
        resumed.clip()
        for p, ref in zip(model.parameters(), outs[t]):
            torch.testing.assert_close(p.grad, ref, rtol=0, atol=0)


@pytest.mark.parametrize("kwargs,field", [({"beta": 1.0}, "beta"), ({"beta": 0.0}, "beta"),
                                           ({"lambda_rel": 0.0}, "lambda_rel"), ({"lambda_abs": -1}, "lambda_abs"),
                                           ({"on_nonfinite": "ignore"}, "on_nonfinite"),
                                           ({"warmup_steps": -1}, "warmup_steps"),
                                           ({"warmup_steps": 2.5}, "warmup_steps"),
                                           ({"lambda_rel": "1.04"}, "lambda_rel"),
                                           ({"eps": -1.0}, "eps"), ({"eps": 0.0}, "eps"),
                                           ({"mode": "shards"}, "mode"),
                                           ({"lambda_abs": float("nan")}, "lambda_abs")])
def test_bad_hyperparameters_name_the_argument(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        AdaGC(small_model(), **kwargs)


@pytest.mark.parametrize("cls,kwargs,field", [
    (ZClip, {"warmup_steps": 2.5}, "warmup_steps"), (ZClip, {"alpha": 1.0}, "alpha"),
    (ZClip, {"max_grad_norm": 0.0}, "max_grad_norm"), (ZClip, {"clip_factor": "x"}, "clip_factor"),
    (ZClip, {"skip_update_on_spike": "yes"}, "skip_update_on_spike"), (ZClip, {"eps": -1e-6}, "eps"),
    (LayerClip, {"alpha": 2}, "alpha"), (LayerClip, {"eps": -1}, "eps"),
    (LayerClip, {"warmup_steps": 0}, "warmup_steps"),
    (GlobalClip, {"max_norm": float("inf")}, "max_norm"), (GlobalClip, {"max_norm": True}, "max_norm"),
    (AdaGC, {"skip_step": "always"}, "skip_step"),
])
def test_every_constructor_names_the_bad_argument(cls, kwargs, field):
    with pytest.raises(ConfigError, match=field):
        cls(small_model(), **kwargs)


def test_a_class_instead_of_a_model_is_a_clear_error():
    with pytest.raises(TypeError, match="torch.nn.Module"):
        AdaGC(AdaGC)


def test_clip_metrics_per_layer(tiny_gpt):
    from gradloc_track.clip.metrics import clip_metrics
    from gradloc_track.grouping import LayerGrouping

    clipper = AdaGC(tiny_gpt, warmup_steps=1)
    g = torch.Generator().manual_seed(0)
    for t in range(3):
        for p in tiny_gpt.parameters():
            p.grad = torch.randn(p.shape, generator=g) * (10.0 if t == 2 else 1.0)
        pre = {n: p.grad.norm().item() for n, p in tiny_gpt.named_parameters()}
        res = clipper.clip()
    post = {n: p.grad.norm().item() for n, p in tiny_gpt.named_parameters()}
    grouping = LayerGrouping.build(clipper.names)
    m = {k: v.item() for k, v in clip_metrics(res, grouping).items()}
    thr = res.thresholds
    for lay, members in grouping.members().items():
        ref_coef = math.sqrt(sum(post[n] ** 2 for n in members) / sum(pre[n] ** 2 for n in members))
        assert m[f"clip/coef/{lay}"] == pytest.approx(ref_coef, rel=1e-5)
        assert m[f"clip/threshold/{lay}"] == pytest.approx(math.sqrt(sum(thr[n] ** 2 for n in members)), rel=1e-5)
    assert m["clip/total_norm_pre"] == pytest.approx(math.sqrt(sum(v * v for v in pre.values())), rel=1e-5)
    assert m["clip/total_norm_post"] == pytest.approx(math.sqrt(sum(v * v for v in post.values())), rel=1e-5)
    assert m["clip/clipped_fraction"] == pytest.approx(sum(c < 1 for c in res.coefs.values()) / len(pre))
