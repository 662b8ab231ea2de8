"""AdamC corrected weight decay follows wd_t = wd * lr_t / lr_max through a real schedule."""
from __future__ import annotations

import pytest
import torch

from gradloc_track.adamc import AdamCWeightDecay


def test_weight_decay_follows_the_schedule():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    decay = [model[0].weight]
    no_decay = [model[0].bias, *model[1].parameters()]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=1e-2)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10, eta_min=1e-4)
    adamc = AdamCWeightDecay(opt)
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


def test_bad_lr_max():
    opt = torch.optim.AdamW(torch.nn.Linear(2, 2).parameters(), lr=1e-3)
    with pytest.raises(ValueError, match="lr_max"):
        AdamCWeightDecay(opt, lr_max=0.0)
