"""The injected garbled span: a prompt of prose and a garbled answer, loss on the answer only."""
from __future__ import annotations

import torch

from gradloc_track.demo.inject import inject


def test_garbled_span_is_a_prompt_of_prose_and_a_garbled_answer():
    B, T = 4, 64
    x = torch.arange(B * T).view(B, T) % 50 + 10  # (B, T) "prose"
    y = x + 1
    mask = torch.ones(B, T)
    prose = x[2, :40].clone()
    pos = inject("garbled_span", x, y, mask, sample=2, span=6, junk_ids=[3, 4, 5])
    assert pos == list(range(40, 46))
    assert torch.equal(x[2, :40], prose) and y[2, 39] == x[2, 40]  # prose stays, shifted targets line up
    assert y[2, 40:46].tolist() == [3, 4, 5, 3, 4, 5] and y[2, 46:].eq(0).all()
    assert mask[2].nonzero().flatten().tolist() == pos  # loss only on the garbled answer
    assert mask[[0, 1, 3]].eq(1).all()
