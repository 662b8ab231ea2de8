"""A step of K micro-batches (gradient accumulation) against the same data as one batch."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import gradloc_track
from gradloc_track.artifacts.table import attribution_table
from gradloc_track.demo.model import TinyGPT
from gradloc_track.spikes import SpikeContext

V, T = 64, 24
CULPRITS = [(1, 5), (2, 17)]  # in the concatenated (4, T) batch: micro-batch 0 holds rows 0-1, 1 holds rows 2-3


def setup():
    torch.manual_seed(0)
    model = TinyGPT(vocab_size=V, n_layer=2, n_head=2, d_model=32, max_seq_len=T, dropout=0.0)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, V, (4, T), generator=g)
    y = torch.randint(0, V, (4, T), generator=g)
    w = torch.ones(4, T)
    for b, t in CULPRITS:
        w[b, t] = 60.0
    norm = 4 * T  # ONE fixed normalizer for the whole step, shared by every micro-batch

    def loss_of(rows):
        def loss_fn(mask):
            per = F.cross_entropy(model(x[rows]).reshape(-1, V), y[rows].reshape(-1), reduction="none")
            return (per.view(mask.shape) * w[rows] * mask).sum() / norm
        return loss_fn

    return model, x, y, loss_of


@pytest.mark.parametrize("method,threshold", [("auto", None), ("auto", 1.0), ("bisect", 1.0)])
def test_two_micro_batches_equal_one_concatenated_batch(method, threshold):
    model, x, y, loss_of = setup()
    whole = gradloc_track.locate(model, loss_of(slice(0, 4)), torch.ones(4, T), method=method, threshold=threshold)
    split = gradloc_track.locate(model, [loss_of(slice(0, 2)), loss_of(slice(2, 4))],
                                 [torch.ones(2, T), torch.ones(2, T)], method=method, threshold=threshold)
    assert {(c.batch, c.position) for c in whole.tokens} == set(CULPRITS)
    assert all(c.micro_batch is None for c in whole.tokens)
    # the same culprits, labelled with their micro-batch and row inside it
    assert {(c.micro_batch, c.batch, c.position) for c in split.tokens} == {(0, 1, 5), (1, 0, 17)}
    assert split.total_norm == pytest.approx(whole.total_norm, rel=1e-5)
    assert split.threshold == pytest.approx(whole.threshold, rel=1e-5)
    by_pos = {(c.batch, c.position): c for c in whole.tokens}
    for c in split.tokens:
        ref = by_pos[(c.batch + 2 * c.micro_batch, c.position)]
        assert c.grad_norm == pytest.approx(ref.grad_norm, rel=1e-5)
        assert c.share == pytest.approx(ref.share, rel=1e-4)
        for lay, v in ref.layer_norms.items():
            assert c.layer_norms[lay] == pytest.approx(v, rel=1e-4, abs=1e-8)
    assert len(split.micro_batch_norms) == 2 and len(split.ghost_maps) == 2
    assert split.ghost_map is None and split.ghost_maps[1].shape == (2, T)
    # the micro-batch norms add up (as vectors) to the step's norm
    assert split.micro_batch_norms[0] + split.micro_batch_norms[1] >= split.total_norm * (1 - 1e-6)
    assert {t["micro_batch"] for t in split.as_dict()["tokens"]} == {0, 1}
    assert all(t["rank"] is None for t in split.as_dict()["tokens"])
    one = split.for_micro_batch(1)
    assert [(c.batch, c.position) for c in one.tokens] == [(0, 17)] and one.ghost_map.shape == (2, T)


def test_only_micro_batches_that_can_hold_a_culprit_are_searched():
    model, x, y, loss_of = setup()
    calm = torch.ones(2, T)
    fns = [loss_of(slice(0, 2)), loss_of(slice(2, 4))]
    both = gradloc_track.locate(model, fns, [calm, calm], method="bisect", threshold=1.0)
    assert {(c.micro_batch, c.batch, c.position) for c in both.tokens} == {(0, 1, 5), (1, 0, 17)}
    # micro-batch 1 without its culprit term: its gradient is within the bisection rule, so it
    # costs its one micro-batch probe and no search
    no_culprit = calm.clone()
    no_culprit[0, 17] = 0.0
    one = gradloc_track.locate(model, fns, [calm, no_culprit], method="bisect", threshold=1.0)
    assert {(c.micro_batch, c.batch, c.position) for c in one.tokens} == {(0, 1, 5)}
    assert one.probes < both.probes


def test_single_micro_batch_sequence_is_labelled_and_matches_the_plain_call():
    model, x, y, loss_of = setup()
    fn = loss_of(slice(0, 4))
    plain = gradloc_track.locate(model, fn, torch.ones(4, T))
    seq = gradloc_track.locate(model, [fn], [torch.ones(4, T)])
    assert [(c.batch, c.position, c.grad_norm) for c in plain.tokens] == \
        [(c.batch, c.position, c.grad_norm) for c in seq.tokens]
    assert plain.probes == seq.probes
    assert {c.micro_batch for c in seq.tokens} == {0}


def test_attribution_table_has_micro_batch_column_and_the_right_token_ids():
    model, x, y, loss_of = setup()
    masks = [torch.ones(2, T), torch.ones(2, T)]
    fns = [loss_of(slice(0, 2)), loss_of(slice(2, 4))]
    ctx = SpikeContext(loss_fn=fns, token_mask=masks, input_ids=[y[:2], y[2:]],
                       extra_columns={"weight": [torch.ones(2, T), 2 * torch.ones(2, T)]})
    assert ctx.micro_batches == 2 and float(ctx.token_count()) == 4 * T
    res = gradloc_track.locate(model, ctx.loss_fn, ctx.token_mask, threshold=1.0)
    cols, rows = attribution_table(7, [], res, ctx)
    assert "micro_batch" in cols and "rank" not in cols
    got = {(r[cols.index("micro_batch")], r[cols.index("sample")], r[cols.index("position")]):
           (r[cols.index("token_id")], r[cols.index("weight")]) for r in rows}
    assert got == {(0, 1, 5): (int(y[1, 5]), 1.0), (1, 0, 17): (int(y[2, 17]), 2.0)}
    view = ctx.micro_batch_view(1)
    assert torch.equal(view.input_ids, y[2:]) and view.micro_batches is None
    plain = gradloc_track.locate(model, loss_of(slice(0, 4)), torch.ones(4, T), threshold=1.0)
    cols, _ = attribution_table(7, [], plain, SpikeContext(loss_of(slice(0, 4)), torch.ones(4, T), input_ids=y))
    assert "micro_batch" not in cols and "rank" not in cols


def test_mismatched_micro_batch_inputs_say_what_to_fix():
    model, x, y, loss_of = setup()
    with pytest.raises(ValueError, match="one loss_fn per micro-batch"):
        gradloc_track.locate(model, [loss_of(slice(0, 2))], [torch.ones(2, T)] * 2)
    with pytest.raises(TypeError, match="list of K callables"):
        gradloc_track.locate(model, loss_of(slice(0, 2)), [torch.ones(2, T)] * 2)
    with pytest.raises(ValueError, match="sequence of 2"):
        SpikeContext(loss_fn=[loss_of(slice(0, 2))] * 2, token_mask=[torch.ones(2, T)] * 2, input_ids=y)


def test_micro_batches_of_different_shapes_against_single_term_backward():
    """auto and bisect on micro-batches of different (B, T); norms against a plain backward."""
    model, x, y, loss_of = setup()
    w = torch.ones(3, T - 4)
    w[2, 9] = 60.0

    def short_loss(mask):  # a second micro-batch with other rows and a shorter sequence
        per = F.cross_entropy(model(x[1:, 4:]).reshape(-1, V), y[1:, 4:].reshape(-1), reduction="none")
        return (per.view(mask.shape) * w * mask).sum() / (4 * T)

    fns, masks = [loss_of(slice(0, 2)), short_loss], [torch.ones(2, T), torch.ones(3, T - 4)]
    want = {(0, 1, 5), (1, 2, 9)}
    for method in ("auto", "bisect"):
        res = gradloc_track.locate(model, fns, masks, method=method)
        assert {(c.micro_batch, c.batch, c.position) for c in res.tokens} == want, method
        assert [m.shape for m in res.ghost_maps] == [(2, T), (3, T - 4)]
        for c in res.tokens:
            m = torch.zeros_like(masks[c.micro_batch])
            m[c.batch, c.position] = 1.0
            model.zero_grad(set_to_none=True)
            fns[c.micro_batch](m).backward()
            ref = sum(float(p.grad.double().pow(2).sum()) for p in model.parameters() if p.grad is not None) ** 0.5
            assert c.grad_norm == pytest.approx(ref, rel=1e-5)
        model.zero_grad(set_to_none=True)


def test_auto_searches_each_micro_batch_remainder_when_the_ranking_misses(monkeypatch):
    """A ranking that names no candidate: the remainder check probes each micro-batch's
    remainder once and bisects only those above the rule, still finding every culprit. (The
    sample stage is blinded too: it would name the culprits' samples, which a blind ranking
    cannot tell from whole bad documents.)"""
    import math
    import sys

    model, x, y, loss_of = setup()
    fns, masks = [loss_of(slice(0, 2)), loss_of(slice(2, 4))], [torch.ones(2, T), torch.ones(2, T)]
    blind = lambda layer_map, mask: torch.full(mask.shape, 0.15) * (mask != 0)  # noqa: E731
    monkeypatch.setattr(sys.modules["gradloc_track.localizer.driver"], "term_scores", blind)
    monkeypatch.setattr(sys.modules["gradloc_track.localizer.levels"], "candidates", lambda segs: ([], math.inf, 0))
    res = gradloc_track.locate(model, fns, masks, method="auto", threshold=1.0)
    assert {(c.micro_batch, c.batch, c.position) for c in res.tokens} == {(0, 1, 5), (1, 0, 17)}
    assert any("remainder" in n for n in res.notes)
    no_culprit = torch.ones(2, T)
    no_culprit[0, 17] = 0.0
    calm = gradloc_track.locate(model, fns, [masks[0], no_culprit], method="auto", threshold=1.0)
    assert {(c.micro_batch, c.batch, c.position) for c in calm.tokens} == {(0, 1, 5)}
    assert calm.probes < res.probes  # micro-batch 1's remainder was probed once, not bisected
