"""The skip guard on an optimizer that steps an inner one: ``ZeroRedundancyOptimizer`` (its ``step``
runs ``self.optim.step`` on this rank's shard). The guard once emptied ZeRO's own param groups, ZeRO
stepped its inner optimizer anyway, and an Inf-loss step made the weights non-finite for good.
On a real gloo process group (one rank in this process, a file rendezvous, a bounded timeout)."""
from __future__ import annotations

import pytest
import torch

import gradloc_track
from gradloc_track.clip import SkipStepGuard, ZClip
from gradloc_track.optim_unwrap import stepped_optimizers

from .helpers import assert_bitwise_equal, mlp, snapshot


def zero(model, **kw):
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-2,
                                   weight_decay=0.1, **kw)


def state(model, opt):
    """Parameters and the inner optimizer's state (ZeRO keeps its own empty), copied."""
    return snapshot(model, opt.optim)


def loss_of(model, step: int, bad: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(8, 4, generator=g)
    loss = model(x).pow(2).mean()
    return loss * float("inf") if bad else loss


def test_zero_steps_an_inner_optimizer(gloo):
    model = mlp()
    opt = zero(model)
    assert stepped_optimizers(opt) == [opt, opt.optim]
    plain = torch.optim.AdamW(model.parameters())
    assert stepped_optimizers(plain) == [plain]


@pytest.mark.parametrize("mode", ["sync", "restore", "fused"])
def test_an_inf_loss_step_under_zero_is_skipped(gloo, mode):
    model = mlp()
    opt = zero(model, **({"fused": True} if mode == "fused" else {}))
    clipper = ZClip(model, warmup_steps=2)
    SkipStepGuard(opt, clipper, mode=mode)
    for step in range(3):
        opt.zero_grad()
        loss_of(model, step).backward()
        clipper.clip()
        opt.step()
    before = state(model, opt)
    opt.zero_grad()
    loss_of(model, 99, bad=True).backward()
    assert clipper.clip().nonfinite
    opt.step()
    assert_bitwise_equal(state(model, opt), before)
    opt.zero_grad()
    loss_of(model, 4).backward()
    clipper.clip()
    opt.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(state(model, opt)[0], before[0]))  # training goes on


def test_watch_skips_an_inf_loss_step_under_zero(gloo, tmp_path):
    """The user's path: ``watch()`` installs the guard; the weights stay finite after an Inf loss."""
    model = mlp()
    opt = zero(model)
    handle = gradloc_track.watch(model, opt, tracker="none", run_dir=tmp_path / "run", locate=False,
                                 spikes=False, log_every=1)
    try:
        for step in range(6):
            opt.zero_grad()
            bad = step == 4
            loss_of(model, step, bad=bad).backward()
            before = state(model, opt)
            opt.step()
            if bad:
                assert_bitwise_equal(state(model, opt), before)
        assert all(torch.isfinite(p).all() for p in model.parameters())
    finally:
        handle.finish()
