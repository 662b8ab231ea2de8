"""segments: each sample's (or packed document's) exact gradient norm over the hooked layers, from the
ghost pass's one backward, against one backward per sample."""
from __future__ import annotations

import pytest
import torch

from gradloc_track.localizer import segments as segments_module
from gradloc_track.localizer.ghost import GhostMap
from gradloc_track.localizer.segments import Segments

from .helpers import B, T, LM, data, sum_loss


def brute_norm(model, loss_fn, keep):
    model.zero_grad(set_to_none=True)
    loss_fn(keep).backward()
    return float(sum(p.grad.pow(2).sum() for p in model.parameters()).sqrt())


def run(model, loss_fn, segs, mask=None):
    """The ghost pass: one backward of the loss over ``mask`` (the segments' own mask)."""
    with GhostMap(model, shape=(B, T), segments=segs):
        loss_fn(torch.ones(B, T) if mask is None else mask).backward()
    return segs.norms()


@pytest.mark.parametrize("chunk", [segments_module.CHUNK, T * T])  # one block, and one row per block
def test_row_norms_equal_each_samples_own_backward(monkeypatch, chunk):
    monkeypatch.setattr(segments_module, "CHUNK", chunk)
    model = LM()
    x, y, w, _ = data(n_culprits=3)
    loss_fn = sum_loss(model, x, y, w)
    segs = Segments(0, torch.ones(B, T))
    got = run(model, loss_fn, segs)
    for b in range(B):
        keep = torch.zeros(B, T)
        keep[b] = 1
        assert got[b] == pytest.approx(brute_norm(model, loss_fn, keep), rel=1e-5)
    assert [(s.batch, s.start, s.end, len(s.terms)) for s in segs.items] == [(b, 0, T, T) for b in range(B)]


def test_packed_documents_are_segments_of_their_own():
    model = LM()
    x, y, w, _ = data(n_culprits=2)
    loss_fn = sum_loss(model, x, y, w)
    docs = torch.zeros(B, T, dtype=torch.long)
    docs[:, 10:] = 1
    docs[2, 20:] = 5
    mask = torch.ones(B, T)
    mask[0, :3] = 0  # terms outside the mask belong to no probe
    segs = Segments(1, mask, docs)
    got = run(model, loss_fn, segs, mask)
    assert len(segs) == 2 * B + 1
    for s, norm in zip(segs.items, got):
        keep = torch.zeros(B, T)
        for b, t in s.terms:
            keep[b, t] = 1
        assert s.micro_batch == 1 and norm == pytest.approx(brute_norm(model, loss_fn, keep), rel=1e-5)
    first = segs.items[0]
    assert (first.batch, first.document, first.start, first.end, len(first.terms)) == (0, 0, 0, 10, 7)


def test_no_hook_no_norms():
    assert Segments(0, torch.ones(2, 3)).norms() is None
