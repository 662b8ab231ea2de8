"""AdamC corrected weight decay: wd_t = wd * lr_t / lr_max through real schedules, the peak read
right for OneCycleLR, and an explicit choice of the corrected groups."""
from __future__ import annotations

import warnings

import pytest
import torch

from gradloc_track.adamc import AdamCWeightDecay, adamc_param_groups


class NormedLM(torch.nn.Module):
    """embedding -> linear -> LayerNorm -> head: one of each kind of parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = torch.nn.Embedding(8, 4)
        self.fc = torch.nn.Linear(4, 4)
        self.ln = torch.nn.LayerNorm(4)
        self.lm_head = torch.nn.Linear(4, 8, bias=False)

    def forward(self, idx):
        return self.lm_head(self.ln(self.fc(self.wte(idx))))


def test_weight_decay_follows_the_schedule():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    decay = [model[0].weight]
    no_decay = [model[0].bias, *model[1].parameters()]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=1e-2)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10, eta_min=1e-4)
    adamc = AdamCWeightDecay(opt, model=model)
    assert adamc.corrected_groups == [0]
    for _ in range(10):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        sched.step()
        adamc.step()
        lr = opt.param_groups[0]["lr"]
        assert opt.param_groups[0]["weight_decay"] == pytest.approx(0.1 * lr / 1e-2)
        assert opt.param_groups[1]["weight_decay"] == 0.0
        # the steady-state ratio sqrt(2*wd_t/lr_t) stays at sqrt(2*wd/lr_max)
        assert (2 * opt.param_groups[0]["weight_decay"] / lr) ** 0.5 == pytest.approx((2 * 0.1 / 1e-2) ** 0.5)


def reference_adam_with_decay(params0, grads, lrs, max_lr, wd, betas=(0.9, 0.999), eps=1e-8):
    """Adam in float64 with decoupled decay ``wd * lr_t**2 / max_lr`` (AdamC's rule under AdamW)."""
    ps = [p.double().clone() for p in params0]
    m = [torch.zeros_like(p) for p in ps]
    v = [torch.zeros_like(p) for p in ps]
    for t, (gs, lr) in enumerate(zip(grads, lrs), start=1):
        for i, (p, g) in enumerate(zip(ps, gs)):
            g = g.double()
            p.mul_(1 - wd * lr * lr / max_lr)
            m[i] = betas[0] * m[i] + (1 - betas[0]) * g
            v[i] = betas[1] * v[i] + (1 - betas[1]) * g * g
            mhat, vhat = m[i] / (1 - betas[0] ** t), v[i] / (1 - betas[1] ** t)
            p.sub_(lr * mhat / (vhat.sqrt() + eps))
    return ps


def test_adamc_with_onecyclelr_equals_the_reference():
    torch.manual_seed(0)
    model = NormedLM().double()
    opt = torch.optim.AdamW(adamc_param_groups(model, weight_decay=0.5), lr=1e-3)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=12, cycle_momentum=False)
    adamc = AdamCWeightDecay(opt, scheduler=sched, model=model)
    assert [b[1] for b in adamc.base] == [0.05] * len(opt.param_groups)  # max_lr, not initial_lr = max_lr/25
    corrected = opt.param_groups[0]["params"]
    assert [id(p) for p in corrected] == [id(model.fc.weight)]
    start = [p.detach().clone() for p in corrected]
    grads, lrs = [], []
    gen = torch.Generator().manual_seed(1)
    for _ in range(12):
        opt.zero_grad()
        model(torch.randint(0, 8, (3, 5), generator=gen)).pow(2).mean().backward()
        grads.append([p.grad.clone() for p in corrected])
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
        adamc.step()
    ref = reference_adam_with_decay(start, grads, lrs, max_lr=0.05, wd=0.5)
    for p, r in zip(corrected, ref):
        torch.testing.assert_close(p.detach(), r, rtol=1e-10, atol=1e-12)
    # embeddings and the head keep the plain decay; 1-D parameters none
    assert opt.param_groups[1]["weight_decay"] == 0.5 and opt.param_groups[2]["weight_decay"] == 0.0


def test_user_marks_decide_the_groups():
    model = NormedLM()
    opt = torch.optim.AdamW([{"params": [model.lm_head.weight], "weight_decay": 0.1, "adamc": True},
                             {"params": [model.fc.weight], "weight_decay": 0.1}], lr=1e-3)
    assert AdamCWeightDecay(opt, model=model).corrected_groups == [0]


def test_a_mixed_group_is_an_error_that_names_the_fix():
    model = NormedLM()
    opt = torch.optim.AdamW([{"params": [model.wte.weight, model.fc.weight], "weight_decay": 0.1}], lr=1e-3)
    with pytest.raises(ValueError, match="adamc_param_groups"):
        AdamCWeightDecay(opt, model=model)


def test_without_model_or_marks_a_warning_says_what_is_corrected():
    opt = torch.optim.AdamW([{"params": [torch.nn.Parameter(torch.zeros(2, 2))], "weight_decay": 0.1}], lr=1e-3)
    with pytest.warns(UserWarning, match="model="):
        assert AdamCWeightDecay(opt).corrected_groups == [0]


def test_lr_above_the_peak_warns_with_the_fix():
    model = NormedLM()
    opt = torch.optim.AdamW(adamc_param_groups(model, 0.1), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 + s)  # a factor above 1
    adamc = AdamCWeightDecay(opt, scheduler=sched, model=model)
    opt.step()
    sched.step()
    with pytest.warns(UserWarning, match="pass lr_max="):
        adamc.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        AdamCWeightDecay(opt, lr_max=1.0, model=model).step()


@pytest.mark.parametrize("lr_max", [0.0, -1.0, "1e-3", True, float("inf"), float("nan")])
def test_bad_lr_max(lr_max):
    opt = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters(), lr=1e-3)
    with pytest.raises(ValueError, match="lr_max"):
        AdamCWeightDecay(opt, lr_max=lr_max)


def test_from_config_takes_an_adamc_config_and_the_example_apps_optim_config():
    from gradloc_track.config import AdamCConfig
    from gradloc_track.demo.config import OptimConfig

    model = NormedLM()
    built = []
    for cfg in (AdamCConfig(enabled=True, lr_max=0.02), OptimConfig(adamc=True, adamc_lr_max=0.02)):
        opt = torch.optim.AdamW(adamc_param_groups(model, weight_decay=0.1), lr=0.01)
        built.append(AdamCWeightDecay.from_config(opt, cfg, model=model))
        # wd_t = wd * lr_t / lr_max with the configured peak, not the groups' lr
        assert opt.param_groups[0]["weight_decay"] == pytest.approx(0.1 * 0.01 / 0.02)
    assert built[0].base == built[1].base
    opt = torch.optim.AdamW(adamc_param_groups(model, weight_decay=0.1), lr=0.01)
    with pytest.raises(ValueError, match="adamc.enabled is false"):
        AdamCWeightDecay.from_config(opt, AdamCConfig(lr_max=0.02), model=model)
    with pytest.raises(ValueError, match="optim.adamc is false"):
        AdamCWeightDecay.from_config(opt, OptimConfig(adamc_lr_max=0.02), model=model)
    with pytest.raises(TypeError, match="neither an OptimConfig"):
        AdamCWeightDecay.from_config(opt, {"lr_max": 0.02}, model=model)
