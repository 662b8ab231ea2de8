"""Localizer faults: non-additive losses, buffers, memory, sparse gradients.

Bad arguments are tested in tests/localizer/test_inputs.py."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import gradloc_track
from gradloc_track.tensor_memory import TensorMemoryMeter

from ..localizer.helpers import LM, B, T, V, data, sum_loss


def test_a_mask_mean_loss_is_rejected_with_the_fix():
    model = LM()
    x, y, w, _ = data()

    def mean_loss(mask):  # a mean over the KEPT terms: subset gradients do not add up
        per = F.cross_entropy(model(x).reshape(-1, V), y.reshape(-1), reduction="none").view(B, T)
        return (per * w * mask).sum() / mask.sum()

    with pytest.raises(ValueError, match="not additive over the mask") as info:
        gradloc_track.locate(model, mean_loss, torch.ones(B, T))
    assert "mask.sum()" in str(info.value) and "n_tokens = token_mask.sum()" in str(info.value)  # the fixed form
    with pytest.raises(ValueError, match=r"not additive over the mask \(micro-batch 1\)"):
        gradloc_track.locate(model, [sum_loss(model, x, y, w), mean_loss], [torch.ones(B, T)] * 2)
    # a loss with a term outside the mask (a constant bonus) is not additive either
    with pytest.raises(ValueError, match="not additive"):
        gradloc_track.locate(model, lambda m: sum_loss(model, x, y, w)(m) + model.head.bias.sum(), torch.ones(B, T))


def test_batchnorm_buffers_are_restored_bitwise():
    model = LM(batchnorm=True).train()
    x, y, w, culprits = data()
    loss_fn = sum_loss(model, x, y, w)
    loss_fn(torch.ones(B, T)).backward()  # the training step moved the running stats once
    before = {n: b.clone() for n, b in model.named_buffers()}
    ids = {n: id(b) for n, b in model.named_buffers()}
    assert int(model.bn.num_batches_tracked) == 1
    res = gradloc_track.locate(model, loss_fn, torch.ones(B, T))
    assert res.probes > 1 and {(c.batch, c.position) for c in res.tokens} == culprits
    for n, b in model.named_buffers():
        assert id(b) == ids[n] and b.dtype == before[n].dtype and torch.equal(b, before[n]), n


def _extra_memory(method: str, n_culprits: int) -> tuple[float, int, int]:
    """Peak tensor bytes ``locate`` holds beyond one plain forward+backward, in gradient sizes."""
    model = LM()
    x, y, w, culprits = data(n_culprits)
    loss_fn = sum_loss(model, x, y, w)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    loss_fn(torch.ones(B, T)).backward()  # the step's own gradients exist, as in training
    with TensorMemoryMeter() as base:
        saved = [p.grad for p in model.parameters()]
        for p in model.parameters():
            p.grad = None
        loss_fn(torch.ones(B, T)).backward()
        for p, g in zip(model.parameters(), saved):
            p.grad = g
    with TensorMemoryMeter() as meter:
        res = gradloc_track.locate(model, loss_fn, torch.ones(B, T), method=method, budget=1000, threshold=0.05)
    assert {(c.batch, c.position) for c in res.tokens} == culprits
    return (meter.peak - base.peak) / grad_bytes, res.probes, len(res.tokens)


@pytest.mark.parametrize("method", ["auto", "bisect", "gradloc"])
def test_peak_extra_memory_does_not_grow_with_the_culprits(method):
    one, _, _ = _extra_memory(method, 1)
    many, probes, found = _extra_memory(method, 32)
    assert found == 32 and probes > 32
    assert many <= 4.0, f"{method}: {many:.2f} gradient sizes held with 32 culprits"
    assert many <= one + 0.25, f"{method}: {one:.2f} -> {many:.2f} gradient sizes from 1 to 32 culprits"


def test_sparse_embedding_gradients_are_localized_and_kept():
    model = LM(sparse=True)
    x, y, w, culprits = data()
    loss_fn = sum_loss(model, x, y, w)
    loss_fn(torch.ones(B, T)).backward()
    assert model.emb.weight.grad.is_sparse
    grad = model.emb.weight.grad
    res = gradloc_track.locate(model, loss_fn, torch.ones(B, T), method="bisect")
    assert {(c.batch, c.position) for c in res.tokens} == culprits
    # exact norm against the dense model's single-term backward
    dense = LM(sparse=False)
    (b, t), = culprits
    m = torch.zeros(B, T)
    m[b, t] = 1.0
    sum_loss(dense, x, y, w)(m).backward()
    ref = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in dense.parameters()))
    assert res.tokens[0].grad_norm == pytest.approx(ref, rel=1e-5)
    assert model.emb.weight.grad is grad and grad.is_sparse  # the step's sparse gradient is put back




def test_a_clippers_unit_coefficients_keep_auto_at_one_gradient_size_a_real_clip_costs_one_more():
    """``grad_scale`` of ones (what the monitor passes when its clipper ran without clipping) leaves
    ``.grad`` the probes' sum: it stands in for the total, as with no ``grad_scale``; a real clip
    (0.5, ``.grad`` halved) does not, so the total is kept beside it. Same culprits and shares."""
    model = LM()
    x, y, w, culprits = data(8)
    loss_fn = sum_loss(model, x, y, w)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    loss_fn(torch.ones(B, T)).backward()
    n = sum(1 for p in model.parameters() if p.requires_grad)
    runs = {}
    for name, scale in (("none", None), ("ones", torch.ones(n)), ("half", 0.5)):
        if name == "half":
            for p in model.parameters():
                p.grad.mul_(0.5)
        with TensorMemoryMeter() as meter:
            res = gradloc_track.locate(model, loss_fn, torch.ones(B, T), threshold=0.05, grad_scale=scale)
        runs[name] = (meter.peak / grad_bytes, sorted((c.batch, c.position, round(c.share, 6)) for c in res.tokens))
    assert {(b, t) for b, t, _ in runs["none"][1]} == culprits
    assert runs["ones"][1] == runs["none"][1] == runs["half"][1]
    assert runs["ones"][0] == pytest.approx(runs["none"][0], abs=0.05)
    assert runs["half"][0] >= runs["none"][0] + 0.5  # the probes' sum kept beside the halved .grad (0.8 here)
