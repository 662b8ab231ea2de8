"""Fault scenarios for clipping (issues 11 and 13): float64, mixed-dtype and sparse gradients through
the monitor and every clipper. Skip means skip: tests/clip/test_skip_step.py; bad clip config:
tests/config/test_clip.py."""
from __future__ import annotations

import math

import pytest
import torch

from gradloc_track import GradMonitor, MemoryTracker
from gradloc_track.clip import AdaGC, GlobalClip, LayerClip, NoClip, ZClip
from gradloc_track.norms import sq_norms

from ..clip.helpers import backward, mlp

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


