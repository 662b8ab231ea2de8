"""What the monitor feeds the spike detector beyond the norms: the update Adam is about to make (checked
against a plain per-tensor loop of Adam's equations), the losses, the weight norm, all in the step's
one transfer."""
from __future__ import annotations

import math

import pytest
import torch

from gradloc_track import GradMonitor, MemoryTracker
from gradloc_track.monitor.detector_inputs import DetectorInputs, sample_max
from gradloc_track.spikes import SpikeContext, SpikeDetector

from .helpers import backward
from .test_packing import spy  # noqa: F401  (the sync-spy fixture)


def reference_update(opt) -> float:
    """Adam's next step at tensor granularity, written out: lr^2 ||m_hat'||^2 / mean(v_hat') summed."""
    total = 0.0
    for g in opt.param_groups:
        b1, b2 = g["betas"]
        for p in g["params"]:
            st = opt.state.get(p)
            if not st or p.grad is None:
                continue
            t = float(st["step"]) + 1
            m = (b1 * st["exp_avg"] + (1 - b1) * p.grad).double() / (1 - b1 ** t)
            v = (b2 * st["exp_avg_sq"] + (1 - b2) * p.grad ** 2).double() / (1 - b2 ** t)
            total += g["lr"] ** 2 * float(m.pow(2).sum()) / (float(v.mean()) + 1e-16)
    return math.sqrt(total)


@pytest.mark.parametrize("fused", [False, True])
def test_update_is_adams_next_step(tiny_gpt, fused):
    params = list(tiny_gpt.parameters())
    opt = torch.optim.AdamW([{"params": params[:4], "lr": 1e-3},
                             {"params": params[4:], "lr": 3e-3, "betas": (0.8, 0.99)}], fused=fused)
    inputs = DetectorInputs(SpikeDetector(), opt, params)
    for step in range(4):
        backward(tiny_gpt, seed=step)
        grad_sq = torch.stack([p.grad.pow(2).sum() for p in params])
        u = inputs.update_norm(params, grad_sq)
        if step == 0:
            assert u is None  # no second moment yet
        else:
            assert float(u) == pytest.approx(reference_update(opt), rel=1e-5)
        opt.step()


def test_update_follows_the_learning_rate_and_skips_other_optimizers(tiny_gpt):
    params = list(tiny_gpt.parameters())
    opt = torch.optim.AdamW(params, lr=1e-3)
    backward(tiny_gpt)
    opt.step()
    backward(tiny_gpt, seed=1)
    grad_sq = torch.stack([p.grad.pow(2).sum() for p in params])
    inputs = DetectorInputs(SpikeDetector(), opt, params)
    u1 = float(inputs.update_norm(params, grad_sq))
    opt.param_groups[0]["lr"] = 1e-2
    assert float(inputs.update_norm(params, grad_sq)) == pytest.approx(10 * u1, rel=1e-6)
    sgd = torch.optim.SGD(params, lr=0.1)
    assert DetectorInputs(SpikeDetector(), sgd, params)._groups == {}
    assert DetectorInputs(SpikeDetector(update_signal=False), opt, params)._groups == {}


def test_sample_max_reads_every_form():
    dev = torch.device("cpu")
    assert float(sample_max(torch.tensor([1.0, 3.0, 2.0]), dev)) == 3.0
    assert float(sample_max([1.0, 4.0], dev)) == 4.0
    assert float(sample_max([torch.tensor([1.0]), torch.tensor([5.0, 2.0])], dev)) == 5.0  # micro-batches
    assert math.isnan(float(sample_max(torch.tensor([1.0, math.nan]), dev)))
    assert sample_max(None, dev) is None


class Recorder(SpikeDetector):
    """The library's detector, keeping what the monitor fed it."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.fed = []

    def update(self, step, global_norm, layer_norms=None, n_tokens=None, n_micro_batches=1, **signals):
        self.fed.append(signals)
        return super().update(step, global_norm, layer_norms, n_tokens, n_micro_batches, **signals)


def test_the_detector_gets_every_input_in_the_one_transfer(tiny_gpt, spy):  # noqa: F811
    opt = torch.optim.AdamW(tiny_gpt.parameters(), lr=1e-3)
    det = Recorder(warmup_steps=2)
    mon = GradMonitor(tiny_gpt, tracker=MemoryTracker(), log_every=100, optimizer=opt, detector=det)
    ctx = SpikeContext(lambda m: tiny_gpt.wte.weight.sum() * m.sum(), torch.ones(2, 16))
    w = math.sqrt(sum(float(p.detach().pow(2).sum()) for p in tiny_gpt.parameters()))
    for step in range(1, 4):
        backward(tiny_gpt, seed=step)
        spy.calls.clear()
        with spy:
            mon.after_backward(step, spike_context=ctx, loss=torch.tensor(2.5), sample_losses=torch.tensor([2.0, 3.0]))
        assert spy.calls == ["tolist"]  # loss, largest sample loss, update and weight norm ride along
        opt.step()
    first, last = det.fed[0], det.fed[-1]
    assert first["loss"] == 2.5 and first["sample_losses"] == [3.0] and "update" not in first  # no Adam state yet
    assert first["weight_norm"] == pytest.approx(w, rel=1e-5)  # measured once, on the first armed step
    assert last["update"] > 0 and last["weight_norm"] == first["weight_norm"]


def test_a_detector_without_the_new_inputs_is_fed_as_before(tiny_gpt):
    opt = torch.optim.AdamW(tiny_gpt.parameters(), lr=1e-3)
    det = Recorder(warmup_steps=2, mode="fixed", per_token_threshold=100.0)
    mon = GradMonitor(tiny_gpt, tracker=MemoryTracker(), optimizer=opt, detector=det)
    backward(tiny_gpt)
    mon.after_backward(0, spike_context=SpikeContext(lambda m: m.sum(), torch.ones(2, 16)), loss=1.0)
    assert det.fed == [{}]  # GradLoc's fixed trigger reads the norm and the token count only
