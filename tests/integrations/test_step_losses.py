"""The step's losses ``watch()`` hands the detector, from what it captures: the model's own loss and
each sample's (or packed document's) mean loss, against a plain per-row loop."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from gradloc_track.integrations.step_losses import (IGNORE, loss_in, step_loss, step_sample_losses,
                                                    unit_loss_max)


def plain_unit_losses(logits, targets, docs, inputs=None):
    """Each (row, document)'s mean loss over its terms, one term at a time; with ``inputs``, a term
    whose target repeats its input token counts at most the batch's mean term loss."""
    terms = {(b, t): float(F.cross_entropy(logits[b, t][None], targets[b, t][None]))
             for b in range(targets.shape[0]) for t in range(targets.shape[1]) if targets[b, t] != IGNORE}
    mean = sum(terms.values()) / len(terms)
    sums, counts = {}, {}
    for (b, t), loss in terms.items():
        if inputs is not None and targets[b, t] == inputs[b, t]:
            loss = min(loss, mean)
        key = (b, int(docs[b, t]))
        sums[key] = sums.get(key, 0.0) + loss
        counts[key] = counts.get(key, 0) + 1
    return {k: sums[k] / counts[k] for k in sums}


def test_largest_sample_loss_matches_a_plain_loop():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 8, 11, generator=g) * 3
    targets = torch.randint(0, 11, (3, 8), generator=g)
    targets[0, 5:] = IGNORE  # padding
    targets[2, :] = IGNORE  # a row without terms is no sample
    rows = plain_unit_losses(logits, targets, torch.zeros(3, 8, dtype=torch.long))
    assert float(unit_loss_max(logits, targets)) == pytest.approx(max(rows.values()), rel=1e-6)
    inputs = torch.randint(0, 11, (3, 8), generator=g)
    inputs[1] = targets[1]  # row 1 repeats its input token everywhere: each term counts at most the mean
    capped = plain_unit_losses(logits, targets, torch.zeros(3, 8, dtype=torch.long), inputs)
    assert float(unit_loss_max(logits, targets, inputs)) == pytest.approx(max(capped.values()), rel=1e-6)
    assert capped[(1, 0)] < rows[(1, 0)] and capped[(0, 0)] == rows[(0, 0)]  # only the repeating row moved
    bad = logits.clone()
    bad[1, 3] = math.nan
    assert math.isnan(float(unit_loss_max(bad, targets)))


def test_the_models_own_loss_is_read_from_its_output():
    loss = torch.tensor(2.5, requires_grad=True)
    assert float(loss_in(SimpleNamespace(loss=loss, logits=None))) == 2.5  # HF's output
    assert float(loss_in((torch.zeros(2, 3, 4), loss))) == 2.5  # nanoGPT's (logits, loss)
    assert loss_in(torch.zeros(2, 3, 4)) is None and not loss_in((loss,)).requires_grad
    batches = [SimpleNamespace(loss=torch.tensor(1.0), sample_max=torch.tensor(3.0)),
               SimpleNamespace(loss=torch.tensor(2.0), sample_max=torch.tensor(4.0))]
    assert float(step_loss(batches)) == 1.5 and [float(v) for v in step_sample_losses(batches)] == [3.0, 4.0]
    assert step_loss([SimpleNamespace(loss=None)]) is None and step_sample_losses([SimpleNamespace()]) is None


def test_a_micro_batch_without_loss_terms_is_left_out_of_the_steps_loss():
    """Every label -100 in one micro-batch: the model's mean over no terms is NaN, which read as "the step's loss
    is NaN, skipped" while the step was applied (held-out tester round 8). Left out; a NaN loss of a micro-batch
    with terms stays NaN, and a step of empty micro-batches reads 0 (no loss to watch)."""
    ninf = torch.tensor(-math.inf)

    def mb(loss, smax):
        return SimpleNamespace(loss=torch.tensor(loss), sample_max=None if smax is None else torch.tensor(smax))

    assert float(step_loss([mb(2.0, 3.0), mb(math.nan, -math.inf), mb(4.0, 5.0)])) == 3.0
    assert math.isnan(float(step_loss([mb(2.0, 3.0), mb(math.nan, math.nan)])))
    assert float(step_loss([mb(math.nan, float(ninf))] * 2)) == 0.0
    assert float(step_loss([mb(2.0, None), mb(4.0, None)])) == 3.0  # without sample losses: the plain mean


def test_watch_feeds_the_detector_the_models_losses():
    """An HF model in a plain loop: the detector gets the model's loss and the largest sample loss (the
    row, also when position ids pack documents into it)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    import gradloc_track
    from gradloc_track import MemoryTracker

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=1, n_head=2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    handle = gradloc_track.watch(model, opt, tracker=MemoryTracker(), locate=False)
    fed = []
    update = handle.monitor.detector.update
    handle.monitor.detector.update = lambda *a, **k: fed.append(k) or update(*a, **k)
    ids = torch.randint(0, 32, (2, 12))
    pos = torch.tensor([0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5]).expand(2, -1)
    out = model(input_ids=ids, labels=ids, position_ids=pos)
    out.loss.backward()
    opt.step()
    handle.finish()
    logits = out.logits.detach()
    tgt = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], IGNORE)], 1)
    docs = torch.tensor([0] * 6 + [1] * 6).expand(2, -1)
    rows = plain_unit_losses(logits, tgt, torch.zeros_like(docs), ids)
    assert fed[0]["loss"] == pytest.approx(float(out.loss.detach()), rel=1e-6)
    assert fed[0]["sample_losses"] == [pytest.approx(max(rows.values()), rel=1e-5)]
    # the junk signal's statistics, from the same forward (spikes/junk.py, tested against a loop there):
    # runs stay inside a packed document, repeats of the input token are the input ids at each position
    from gradloc_track.spikes.junk import junk_span

    want = junk_span(logits, tgt, ids, docs, terms=handle.monitor.detector.config.junk_terms)
    short = junk_span(logits, tgt, ids, docs, terms=4)
    # the excess is a difference of O(1) log-probabilities (watch() reads them from the loss's graph): nats
    assert fed[0]["junk_span"] == (float(want.span), pytest.approx(float(want.mean), abs=1e-5), float(want.leak))
    assert float(want.span) == -math.inf and math.isfinite(float(short.span))  # 16 > a document of 6


def test_watch_measures_runs_of_the_configured_length():
    from transformers import GPT2Config, GPT2LMHeadModel

    import gradloc_track
    from gradloc_track import MemoryTracker
    from gradloc_track.spikes.junk import junk_span

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=1, n_head=2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    handle = gradloc_track.watch(model, opt, tracker=MemoryTracker(), locate=False, spikes={"junk_terms": 4})
    fed = []
    update = handle.monitor.detector.update
    handle.monitor.detector.update = lambda *a, **k: fed.append(k) or update(*a, **k)
    ids = torch.randint(0, 32, (2, 12))
    labels = ids.clone()
    labels[:, :3] = IGNORE  # a masked prompt
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    opt.step()
    handle.finish()
    tgt = torch.cat([labels[:, 1:], torch.full_like(ids[:, :1], IGNORE)], 1)
    want = junk_span(out.logits.detach(), tgt, ids, terms=4)
    assert fed[0]["junk_span"] == (pytest.approx(float(want.span), abs=1e-5), pytest.approx(float(want.mean), abs=1e-5),
                                   float(want.leak))


def test_rows_read_in_blocks_give_the_same_losses(monkeypatch):
    import gradloc_track.spikes.term_stats as term_stats

    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 9, 5, generator=g)
    targets = torch.randint(0, 5, (2, 9), generator=g)
    whole = float(unit_loss_max(logits, targets))
    monkeypatch.setattr(term_stats, "CPU_BLOCK", 2 * 5)  # 2 positions a block
    assert float(unit_loss_max(logits, targets)) == pytest.approx(whole, rel=1e-6)
    assert whole == pytest.approx(max(plain_unit_losses(logits, targets, torch.zeros(2, 9, dtype=torch.long)).values()),
                                  rel=1e-6)


@pytest.mark.parametrize("packed", [False, True])
def test_the_shared_pass_equals_each_signal_computed_on_its_own(packed):
    """``detector_losses`` makes the term counts and the repeat mask once for both signals (issue 38): its
    values are bit for bit those of ``sample_losses``, ``cap_repeats`` and ``junk_of`` called one by one."""
    from gradloc_track.integrations.step_losses import detector_losses
    from gradloc_track.spikes.junk import cap_repeats, junk_of
    from gradloc_track.spikes.sample_loss import sample_losses
    from gradloc_track.spikes.term_stats import term_stats

    g = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 40, 9, generator=g) * 3
    inputs = torch.randint(0, 4, (3, 40), generator=g)  # few ids: repeats and copied labels
    targets = torch.cat([inputs[:, 1:], inputs[:, -1:]], 1)
    targets[:, -1], targets[0, 5:9] = IGNORE, IGNORE
    targets[2, :20] = inputs[2, :20]  # leaked labels on a row
    logits[1, 3, 2] = -math.inf  # a vocabulary mask
    docs = torch.arange(40).expand(3, 40) // 13 if packed else None
    smax, junk = detector_losses(logits, targets, inputs, docs, junk_terms=4)
    valid = targets != IGNORE
    stats = term_stats(logits, targets.clamp(min=0), log_probs=False)
    want_max = sample_losses(stats.loss.view(3, 40), valid, inputs, targets).max()
    want = junk_of(cap_repeats(stats.excess.view(3, 40), targets, inputs), valid, docs, 4, targets, inputs)
    assert torch.equal(smax, want_max)
    for got, exp in zip(junk, want):
        assert torch.equal(got, exp), (got, exp)


def test_micro_batch_losses_over_the_whole_steps_count_are_summed():
    """Tester round 12: HF Trainer passes each micro-batch ``num_items_in_batch``, the whole step's count, so each
    micro-batch's loss is a part of the step's; their mean read 0.911 for the 3.644 Trainer logged at K = 4."""
    def mb(loss, smax=None):
        return SimpleNamespace(loss=torch.tensor(loss), num_items=torch.tensor(40),
                               sample_max=None if smax is None else torch.tensor(smax))

    assert float(step_loss([mb(0.9), mb(1.0), mb(0.8), mb(0.944)])) == pytest.approx(3.644)
    assert float(step_loss([mb(0.9, 3.0), mb(1.0, -math.inf), mb(0.8, 2.0)])) == pytest.approx(1.7)  # empty: 0
