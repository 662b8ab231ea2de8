"""Fault scenarios for clipping (issues 11 and 13): skip means skip, float64 / mixed-dtype / sparse
gradients, the LayerClip threshold metric, bad clip config, and the sync contract of the fixes."""
from __future__ import annotations

import copy
import math

import pytest
import torch

from gradloc_track import GradMonitor, MemoryTracker
from gradloc_track.clip import AdaGC, GlobalClip, LayerClip, NoClip, SkipStepGuard, ZClip
from gradloc_track.config import AdaGCConfig, ConfigError, GlobalClipConfig, LayerClipConfig, ZClipConfig
from gradloc_track.norms import sq_norms

from ..monitor.test_host_sync import SyncSpy


def mlp(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)).to(dtype)


def backward(model, seed, nan=False):
    g = torch.Generator().manual_seed(seed)
    dtype = next(model.parameters()).dtype
    model.zero_grad(set_to_none=True)
    model(torch.randn(5, 4, generator=g).to(dtype)).pow(2).mean().backward()
    if nan:
        model[0].weight.grad[0, 0] = float("nan")


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


CLIPPERS = {
    "none": lambda m: NoClip(m),
    "global": lambda m: GlobalClip(m, 0.5),
    "adagc": lambda m: AdaGC(m, warmup_steps=2),
    "adagc_shard": lambda m: AdaGC(m, warmup_steps=2, mode="shard"),
    "adagc_global": lambda m: AdaGC(m, warmup_steps=2, mode="global"),
    "zclip": lambda m: ZClip(m, warmup_steps=2, max_grad_norm=1.0),
    "layerclip": lambda m: LayerClip(m, warmup_steps=2),
}


@pytest.mark.parametrize("name", list(CLIPPERS))
def test_float64_models_train_with_every_clipper(name):
    model = mlp(torch.float64)
    clipper = CLIPPERS[name](model)
    mon = GradMonitor(model, tracker=MemoryTracker(), clipper=clipper, log_every=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(6):
        backward(model, step)
        pre = [p.grad.clone() for p in model.parameters()]
        stats = mon.after_backward(step)
        ref = math.sqrt(sum(g.norm().item() ** 2 for g in pre))
        assert stats.global_norm == pytest.approx(ref, rel=1e-6)
        coefs = stats.clip.coefs
        for (n, p), g in zip(model.named_parameters(), pre):
            assert p.grad.dtype == torch.float64
            torch.testing.assert_close(p.grad, g * coefs[n], rtol=1e-6, atol=0)
        opt.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_global_clip_float64_equals_clip_grad_norm():
    a, b = mlp(torch.float64), mlp(torch.float64)
    for m in (a, b):
        backward(m, 0)
        for p in m.parameters():
            p.grad *= 10
    GlobalClip(a, 1.0).clip()
    torch.nn.utils.clip_grad_norm_(b.parameters(), 1.0, foreach=True)
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=0)


def test_mixed_dtypes_get_the_fp32_coefficient_in_their_own_dtype():
    model = mlp()
    model[0].to(torch.bfloat16)  # first tensors bf16, the rest fp32
    g = torch.Generator().manual_seed(0)
    for p in model.parameters():
        p.grad = (torch.randn(p.shape, generator=g) * 3).to(p.dtype)
    pre = [p.grad.double() for p in model.parameters()]
    total = math.sqrt(sum(x.norm().item() ** 2 for x in pre))
    assert sq_norms([p.grad for p in model.parameters()]).sum().sqrt().item() == pytest.approx(total, rel=1e-6)
    res = GlobalClip(model, 1.0).clip()
    coef = 1.0 / (total + 1e-6)
    assert res.coefs["2.weight"] == pytest.approx(coef, rel=1e-6)
    for p, x in zip(model.parameters(), pre):
        if p.dtype == torch.float32:  # was 0.12% off: the coefficient had been rounded to bf16
            torch.testing.assert_close(p.grad.double(), x * coef, rtol=1e-6, atol=0)
        else:
            assert torch.equal(p.grad, (x * coef).to(torch.bfloat16))  # fp32 product, rounded once


class SparseLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(20, 4, sparse=True)
        self.out = torch.nn.Linear(4, 3)

    def forward(self, idx):
        return self.out(self.emb(idx))


@pytest.mark.parametrize("name", list(CLIPPERS))
def test_sparse_gradients_are_measured_and_clipped(name):
    torch.manual_seed(0)
    model = SparseLM()
    clipper = CLIPPERS[name](model)
    mon = GradMonitor(model, tracker=MemoryTracker(), clipper=clipper, log_every=1)
    for step in range(4):
        model.zero_grad(set_to_none=True)
        idx = torch.tensor([[1, 2, 1, 7], [7, 7, 3, 1]])  # repeated rows: an uncoalesced sparse gradient
        (model(idx).pow(2).sum() * (1 + 20 * (step == 3))).backward()
        assert model.emb.weight.grad.is_sparse
        dense = [p.grad.to_dense().double() for p in model.parameters()]
        stats = mon.after_backward(step)
        assert stats.global_norm == pytest.approx(math.sqrt(sum(d.norm().item() ** 2 for d in dense)), rel=1e-6)
        for (n, p), d in zip(model.named_parameters(), dense):
            torch.testing.assert_close(p.grad.to_dense().double(), d * stats.clip.coefs[n], rtol=1e-6, atol=1e-9)


def test_layerclip_logs_the_threshold_it_applies(tiny_gpt):
    clipper = LayerClip(tiny_gpt, z_thresh=2.0, alpha=0.9, warmup_steps=4)
    tracker = MemoryTracker()
    mon = GradMonitor(tiny_gpt, tracker=tracker, clipper=clipper, log_every=1)
    g = torch.Generator().manual_seed(0)
    for step in range(6):
        for n, p in tiny_gpt.named_parameters():
            p.grad = torch.randn(p.shape, generator=g) * (40.0 if step == 5 and n.startswith("h.1.") else 1.0)
        mon.after_backward(step)
    layer_after = math.sqrt(sum(p.grad.norm().item() ** 2 for n, p in tiny_gpt.named_parameters()
                                if n.startswith("h.1.")))
    logged = dict(tracker.metrics[-1][1])["clip/threshold/h.1"]
    assert logged == pytest.approx(layer_after, rel=1e-4)  # was sqrt(#tensors) too large


@pytest.mark.parametrize("schema,field,value", [
    (LayerClipConfig, "alpha", 2), (AdaGCConfig, "eps", -1.0), (AdaGCConfig, "eps", 0.0), (ZClipConfig, "alpha", 0.0),
    (AdaGCConfig, "beta", "0.9"), (AdaGCConfig, "warmup_steps", -1), (ZClipConfig, "warmup_steps", 0),
    (ZClipConfig, "clip_factor", 0.0), (ZClipConfig, "max_grad_norm", -1.0),
    (LayerClipConfig, "z_thresh", float("inf")), (AdaGCConfig, "mode", "AdaGC-Shard"),
    (ZClipConfig, "skip_update_on_spike", "yes"), (GlobalClipConfig, "max_norm", float("nan")),
    (LayerClipConfig, "on_nonfinite", "ignore"), (GlobalClipConfig, "skip_step", "maybe")])
def test_bad_clip_config_names_the_field(schema, field, value):
    with pytest.raises(ConfigError, match=rf"clip\.{field}="):
        schema(**{field: value})


def test_bad_clip_override_fails_at_composition_naming_the_field():
    from hydra import compose, initialize_config_dir

    from gradloc_track.config import to_config
    from gradloc_track.demo.config import register_configs

    from ..conftest import CONF_DIR

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        with pytest.raises(ConfigError, match=r"clip\.alpha=2"):
            to_config(compose("config", overrides=["clip=layerclip", "clip.alpha=2"]))
        cfg = to_config(compose("config", overrides=["clip=zclip", "clip.max_grad_norm=1.0",
                                                     "clip.skip_update_on_spike=true", "clip.clip_factor=0.8"]))
    assert (cfg.clip.max_grad_norm, cfg.clip.skip_update_on_spike, cfg.clip.clip_factor) == (1.0, True, 0.8)


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
    import warnings

    model = mlp()
    opt = OPTIMIZERS["adamw"](model.parameters())
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
