"""Rows whose labels leaked are named as culprits with their exact share, whatever that share is."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from gradloc_track.localizer.flagged import flagged_rows
from gradloc_track.spikes.junk import LEAKED, LEAKED_COLUMN


def test_flagged_rows_per_micro_batch_and_a_column_that_does_not_fit():
    one = {LEAKED_COLUMN: torch.tensor([0.0, LEAKED, 0.49, 1.0])}
    assert flagged_rows(one, 1) == [[1, 3]]
    two = {LEAKED_COLUMN: [torch.tensor([0.9, 0.0]), [None, None]]}
    assert flagged_rows(two, 2) == [[0], []]
    assert flagged_rows(two, 3) == [[], [], []]  # a column of another step's shape: nothing flagged
    assert flagged_rows({}, 2) == [[], []]


def _oracle_shares(model, ids, labels, rows):
    """Brute force: each row's loss terms' gradient against the step's, <g_row, g> / ||g||^2."""
    m = copy.deepcopy(model)

    def grads(row=None):
        m.zero_grad()
        logits = m(input_ids=ids).logits[:, :-1].double()
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), reduction="none")
        ce = ce.view(ids.shape[0], -1)
        (ce.sum() if row is None else ce[row].sum()).div(ce.numel()).backward()
        return torch.cat([p.grad.double().flatten() for p in m.parameters() if p.grad is not None])

    g = grads()
    return {r: float(grads(r) @ g / (g @ g)) for r in rows}


def test_leaked_rows_are_culprits_with_their_exact_share():
    """watch() on a GPT-2 whose collator forgot to shift 3 of 8 rows' labels: the event's culprits are
    exactly those rows (their gradient is no outlier), each share equal to the brute-force oracle's."""
    from transformers import GPT2Config, GPT2LMHeadModel

    import gradloc_track
    from gradloc_track import MemoryTracker

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=64, n_positions=24, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    handle = gradloc_track.watch(model, opt, tracker=MemoryTracker())
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        ids = torch.randint(0, 64, (8, 24), generator=g)
        labels = ids.clone()
        if step == 2:
            labels[[1, 4, 6]] = torch.roll(ids[[1, 4, 6]], 1, 1)  # the model shifts: its targets become the inputs
            want = _oracle_shares(model, ids, labels, [1, 4, 6])
        model(input_ids=ids, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()
    handle.finish()
    (stats,) = handle.spikes
    rows = {c.batch: c for c in stats.locate.culprits}
    assert sorted(rows) == [1, 4, 6] and all(c.level == "sample" for c in rows.values())
    for b, share in want.items():
        assert rows[b].share == pytest.approx(min(1.0, max(0.0, share)), rel=1e-3, abs=1e-6)
    assert any("named for leaked labels" in n for n in stats.locate.notes)
