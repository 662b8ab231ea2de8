"""Surgery from the search's own sum of the culprits' probes (issue 38, item 4: ``localizer/cut.py``):
no probe of its own, and the same step as the extra probe gave, both against an independent
reference, a plain recompute of each micro-batch's loss without the culprits' terms."""
from __future__ import annotations

import pytest
import torch

import gradloc_track
from gradloc_track.localizer.cut import CulpritCut
from gradloc_track.localizer.probe import restore_rng
from gradloc_track.localizer.step import LocateStep
from gradloc_track.localizer.surgery import operate

from .oracles import grads_of, norm
from .test_surgery import B, K, T, V, batches, loss_fns, train_step
from .oracles import tiny_gpt

REL = 1e-6


def without(model, fns, rngs, cells: dict[int, list[tuple[int, int]]], divisor: float = 1.0) -> list[torch.Tensor]:
    """The step's gradient with the culprits' terms left out: each micro-batch's loss recomputed at the full
    mask less those terms (its dropout replayed), one plain backward each, summed."""
    total = [torch.zeros_like(p) for p in model.parameters()]
    for k in range(K):
        mask = torch.ones(B, T)
        for b, t in cells.get(k, []):
            mask[b, t] = 0.0
        restore_rng(rngs[k])
        for acc, g in zip(total, grads_of(model, fns[k](mask) / divisor)):
            acc += g
    return total


def err(got: list[torch.Tensor], want: list[torch.Tensor], scale: list[torch.Tensor]) -> float:
    return norm([a - b for a, b in zip(got, want)]) / norm(scale)


def operated(model, fns, rngs, res, cut):
    """``.grad`` after surgery (with or without the search's sum), and the surgery result; ``.grad`` put back."""
    saved = [p.grad.clone() for p in model.parameters()]
    out = operate(model, LocateStep(fns, [torch.ones(B, T)] * K, rng_state=rngs), res, cut)
    after = [p.grad.clone() for p in model.parameters()]
    for p, g in zip(model.parameters(), saved):
        p.grad = g
    return out, after


@pytest.mark.parametrize("loop_divisor", [1.0, K])
@pytest.mark.parametrize("reuse_forward", [False, True])
def test_culprit_tokens_are_cut_out_without_a_probe(loop_divisor, reuse_forward):
    model = tiny_gpt(V, T, dropout=0.1)
    heavy = {(1, 2, 7): 60.0, (1, 2, 8): 50.0, (2, 0, 3): 45.0}
    x, y, w = batches(heavy)
    fns = loss_fns(model, x, y, w)
    rngs, _ = train_step(model, fns, loop_divisor)
    cut = CulpritCut()
    res = gradloc_track.locate(model, fns, [torch.ones(B, T)] * K, rng_state=rngs, cut=cut,
                               reuse_forward=reuse_forward)
    assert sorted((c.level, c.micro_batch, c.batch, c.position) for c in res.culprits) == \
        sorted(("token", *cell) for cell in heavy)
    assert cut.grads is not None
    reused, after = operated(model, fns, rngs, res, cut)
    probed, before = operated(model, fns, rngs, res, None)
    assert (reused.applied, reused.probes, probed.applied, probed.probes) == (True, 0, True, 1)
    want = without(model, fns, rngs, {1: [(2, 7), (2, 8)], 2: [(0, 3)]}, loop_divisor)
    # float32 rounding of a difference of two gradients: measured against the step's own norm
    step = [p.grad for p in model.parameters()]
    assert err(after, want, step) < REL and err(before, want, step) < REL
    assert err(after, before, step) < REL
    for f in ("removed_share", "grad_norm_pre", "grad_norm_post", "culprit_norm", "scale"):
        assert getattr(reused, f) == pytest.approx(getattr(probed, f), rel=1e-6), f


def one_culprit():
    """The step of one heavy term (micro-batch 0, row 1, position 7), located with a cut kept."""
    model = tiny_gpt(V, T, dropout=0.1)
    x, y, w = batches({(0, 1, 7): 60.0})
    fns = loss_fns(model, x, y, w)
    rngs, _ = train_step(model, fns)
    cut = CulpritCut()
    res = gradloc_track.locate(model, fns, [torch.ones(B, T)] * K, rng_state=rngs, cut=cut)
    return model, fns, rngs, res, cut


def test_a_cut_that_does_not_cover_the_culprits_is_not_used():
    """When the terms the search summed differ from the culprit rows (here one term more: a sample the
    levels explained whose span or tokens were named, a row under the share floor), surgery probes as before."""
    model, fns, rngs, res, cut = one_culprit()
    assert [(c.micro_batch, c.batch, c.position) for c in res.culprits] == [(0, 1, 7)]
    cut.keys = cut.keys | {(0, 1, 8)}  # one term more than the culprits hold
    out, after = operated(model, fns, rngs, res, cut)
    assert out.applied and out.probes == 1
    assert err(after, without(model, fns, rngs, {0: [(1, 7)]}), [p.grad for p in model.parameters()]) < REL


def test_covers_compares_the_terms_exactly():
    from gradloc_track.localizer.result import CulpritToken

    cut = CulpritCut()
    rows = [CulpritToken(0, 2, grad_norm=1.0, share=0.4, micro_batch=1)]
    masks = [torch.zeros(2, 3), torch.zeros(2, 3)]
    assert not cut.covers(masks, rows)  # nothing kept
    masks[1][0, 2] = 0.5
    cut.keep([torch.ones(1)], {(1, 0, 2)}, 0.4)
    assert cut.covers(masks, rows)
    masks[0][1, 1] = 1.0
    assert not cut.covers(masks, rows)
    cut.keep([torch.ones(1)], {(1, 0, 2), (0, 1, 1), (0, 0, 0)}, 0.4)
    assert not cut.covers(masks, rows)
    assert norm(cut.grads) == 1.0


def test_a_sum_whose_share_is_not_the_culprits_is_not_used():
    """The keys match but the running sum holds more than the culprit rows (a term added twice): its share
    of the step says so, and surgery probes instead of removing a term twice."""
    from gradloc_track.localizer.result import CulpritToken

    masks = [torch.zeros(2, 3)]
    masks[0][0, 2] = 1.0
    cut = CulpritCut()
    cut.keep([torch.ones(1)], {(0, 0, 2)}, 0.8)  # twice the row's 0.4
    assert not cut.covers(masks, [CulpritToken(0, 2, grad_norm=1.0, share=0.4)])
    assert not cut.covers(masks, [CulpritToken(0, 2, grad_norm=1.0, share=None)])  # a share unknown: not used
    cut.keep([torch.ones(1)], {(0, 0, 2)}, 0.4 + 1e-5)  # float rounding of the same sum
    assert cut.covers(masks, [CulpritToken(0, 2, grad_norm=1.0, share=0.4)])

    model, fns, rngs, res, cut = one_culprit()
    assert operated(model, fns, rngs, res, cut)[0].probes == 0
    cut.grads, cut.share = [2 * g for g in cut.grads], 2 * cut.share  # the one term summed twice
    out, after = operated(model, fns, rngs, res, cut)
    assert out.applied and out.probes == 1
    assert err(after, without(model, fns, rngs, {0: [(1, 7)]}), [p.grad for p in model.parameters()]) < REL
