"""Spike surgery (issue 19, item 4): ``.grad`` minus the culprits' exact gradient, checked against a
separate backward of the culprits' terms (a plain per-parameter loop), at every culprit level."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import gradloc_track
from gradloc_track.localizer import Culprit, CulpritToken, LocateResult, StepCheck, remove_culprits
from gradloc_track.localizer.probe import restore_rng, save_rng

from .oracles import dot, grads_of, norm, tiny_gpt

V, B, T, K = 64, 4, 16, 3
REL = 1e-6


def batches(heavy: dict[tuple[int, int, int], float], seed: int = 0, k: int = K):
    """``k`` micro-batches of random tokens; ``heavy``: (micro_batch, b, t) -> that term's loss weight."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, V, (k, B, T), generator=g)
    y = torch.randint(0, V, (k, B, T), generator=g)
    w = torch.ones(k, B, T)
    for cell, v in heavy.items():
        w[cell] = v
    return x, y, w


def loss_fns(model, x, y, w, divide_by: float = 1.0):
    """Micro-batch k's loss restricted to ``mask``, with a fixed normaliser (``divide_by``: the
    loop's accumulation divisor, when the loss_fn carries it)."""
    def make(k):
        def loss_fn(mask):
            per = F.cross_entropy(model(x[k]).reshape(-1, V), y[k].reshape(-1), reduction="none").view(B, T)
            return (per * w[k] * mask).sum() / (B * T * divide_by)
        return loss_fn
    return [make(k) for k in range(K)]


def train_step(model, fns, loop_divisor: float = 1.0):
    """The loop's backward over K micro-batches (dropout on), each after its own saved RNG state."""
    model.train()
    model.zero_grad(set_to_none=True)
    rngs = []
    for fn in fns:
        rngs.append(save_rng())
        (fn(torch.ones(B, T)) / loop_divisor).backward()
    return rngs, [p.grad.detach().clone() for p in model.parameters()]


def reference_cut(model, fns, rngs, cells: dict[int, list[tuple[int, int]]]) -> list[torch.Tensor]:
    """The culprits' gradient: one plain backward per micro-batch of the culprits' terms."""
    total = [torch.zeros_like(p) for p in model.parameters()]
    for k, terms in cells.items():
        mask = torch.zeros(B, T)
        for b, t in terms:
            mask[b, t] = 1.0
        restore_rng(rngs[k])
        for acc, g in zip(total, grads_of(model, fns[k](mask))):
            acc += g
    return total


def rel_err(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    return norm([a - b for a, b in zip(got, want)]) / norm(want)


def test_every_culprit_level_is_cut_out_exactly():
    """A token, a span, a whole sample, a packed document and a whole micro-batch: one probe of
    their masks, subtracted; equal to a separate backward of exactly those terms."""
    model = tiny_gpt(V, T, dropout=0.1)
    x, y, w = batches({})
    fns = loss_fns(model, x, y, w)
    rngs, step = train_step(model, fns)
    docs = [torch.zeros(B, T, dtype=torch.long) for _ in range(K)]
    docs[1][3, 5:11] = 1
    culprits = [CulpritToken(batch=1, position=3, grad_norm=1.0, micro_batch=0),
                Culprit("span", 1.0, micro_batch=0, batch=2, start=4, end=9),
                Culprit("sample", 1.0, micro_batch=1, batch=0, start=0, end=T),
                Culprit("sample", 1.0, micro_batch=1, batch=3, start=5, end=11, document=1),
                Culprit("micro_batch", 1.0, micro_batch=2)]
    result = LocateResult(tokens=[culprits[0]], probes=0, method="auto", threshold=1.0, total_norm=1.0,
                          culprits=culprits, step_check=StepCheck(0.0, 1.0, True, scale=1.0))
    out = remove_culprits(model, fns, [torch.ones(B, T)] * K, result, rng_state=rngs, document_ids=docs)
    cells = {0: [(1, 3)] + [(2, t) for t in range(4, 9)],
             1: [(0, t) for t in range(T)] + [(3, t) for t in range(5, 11)],
             2: [(b, t) for b in range(B) for t in range(T)]}
    cut = reference_cut(model, fns, rngs, cells)
    want = [g - c for g, c in zip(step, cut)]
    assert out.applied and out.probes == 1 and out.culprits == 5
    assert rel_err([p.grad for p in model.parameters()], want) < REL
    assert out.removed_share == pytest.approx(dot(cut, step) / dot(step, step), rel=1e-6)
    assert out.grad_norm_post == pytest.approx(norm(want), rel=1e-6)
    assert out.culprit_norm == pytest.approx(norm(cut), rel=1e-6)


@pytest.mark.parametrize("loop_divisor", [1.0, K])
def test_a_localized_spike_is_cut_out_in_the_steps_own_units(loop_divisor):
    """With accumulation the loop may divide by K while loss_fn does not: the step check's scale
    puts the culprits' gradient in .grad's units."""
    model = tiny_gpt(V, T, dropout=0.1)
    x, y, w = batches({(1, 2, 7): 60.0})
    fns = loss_fns(model, x, y, w)
    rngs, step = train_step(model, fns, loop_divisor)
    res = gradloc_track.locate(model, fns, [torch.ones(B, T)] * K, rng_state=rngs)
    assert [(c.micro_batch, c.batch, c.position) for c in res.culprits] == [(1, 2, 7)]
    assert res.step_check.scale == pytest.approx(1.0 / loop_divisor, rel=1e-6)
    out = remove_culprits(model, fns, [torch.ones(B, T)] * K, res, rng_state=rngs)
    cut = reference_cut(model, fns, rngs, {1: [(2, 7)]})
    want = [g - c / loop_divisor for g, c in zip(step, cut)]
    assert out.applied and rel_err([p.grad for p in model.parameters()], want) < REL
    assert out.removed_share == pytest.approx(sum(c.share for c in res.culprits), rel=1e-4)
    assert 0.5 < out.removed_share < 0.99  # most of the step, not all: the remainder is measurable in float32


def test_nothing_found_or_a_gradient_rescaled_per_tensor_is_left_alone():
    model = tiny_gpt(V, T)
    x, y, w = batches({(0, 1, 1): 400.0})
    fns = loss_fns(model, x, y, w)
    rngs, step = train_step(model, fns)
    masks = [torch.ones(B, T)] * K
    res = gradloc_track.locate(model, fns, masks, method="ghost", threshold=1e9, rng_state=rngs)
    out = remove_culprits(model, fns, masks, res, rng_state=rngs)
    assert not out.applied and "no culprit found" in out.reason
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), step))
    for j, p in enumerate(model.parameters()):  # clipped per tensor before localizing (AdaGC-like)
        p.grad.mul_(0.1 + 0.05 * (j % 7))
    scaled = [p.grad.clone() for p in model.parameters()]
    res = gradloc_track.locate(model, fns, masks, rng_state=rngs)
    assert res.culprits and res.step_check.replayed and res.step_check.scale is None
    out = remove_culprits(model, fns, masks, res, rng_state=rngs)
    assert not out.applied and "tensor by tensor" in out.reason
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), scaled))
