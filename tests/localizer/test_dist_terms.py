"""``dist_terms``: every rank's terms, samples and pieces in one numbering (no process group needed
for the numbering), and a piece's exact norm over the hooked layers from the ghost backward."""
from __future__ import annotations

import pytest
import torch

from gradloc_track.localizer.dist_terms import GlobalTerms, PieceNorm
from gradloc_track.localizer.ghost import GhostMap
from gradloc_track.localizer.result import Culprit, CulpritToken
from gradloc_track.localizer.segments import Segments

from .oracles import norm, term_mask
from .test_levels import weighted


@pytest.mark.parametrize("docs", [False, True], ids=["rows", "packed"])
def test_a_pieces_norm_is_its_gradients_over_the_hooked_layers(docs):
    """Against a plain backward of the whole micro-batch: linear weights and biases, the embedding
    (rows of a repeated token add up); layer norms and the position table are not hooked. The
    samples' norms are still fed to the wrapped ``Segments``."""
    B, T = 3, 10
    model, loss_fn = weighted(B, T, {(1, 4): 30.0})
    mask = torch.ones(B, T)
    mask[2, 6:] = 0.0
    ids = torch.zeros(B, T, dtype=torch.long)
    ids[0, 5:] = 1
    piece = PieceNorm(Segments(0, mask, ids if docs else None))
    with GhostMap(model, "block", (B, T), segments=piece):
        model.zero_grad(set_to_none=True)
        loss_fn(mask).backward()
    hooked = [p for n, p in model.named_parameters() if "ln" not in n and "wpe" not in n]
    assert piece.norm() == pytest.approx(norm([p.grad for p in hooked]), rel=1e-5)
    assert len(piece.segments.norms()) == (4 if docs else 3)
    one = term_mask((B, T), [(1, t) for t in range(T)])
    model.zero_grad(set_to_none=True)
    loss_fn(one).backward()
    assert piece.segments.norms()[-2 if docs else 1] == pytest.approx(norm([p.grad for p in hooked]), rel=1e-5)
    model.zero_grad(set_to_none=True)


def terms_of_two_ranks() -> GlobalTerms:
    """Rank 0: one micro-batch row with terms; rank 1: rows 0 and 2 of micro-batch 1 (a packed
    document in row 2), as ``gather_terms`` receives them."""
    out = GlobalTerms(world=2, k=2)
    out.add_rank(0, [(0, torch.tensor([[1, 3], [1, 4]]), torch.tensor([0.5, 0.25]),
                      [(1, None, 0, 8, 0.7, [3, 4])], 0.7),
                     (1, torch.zeros(0, 2, dtype=torch.long), torch.zeros(0), [], None)])
    out.add_rank(1, [(0, torch.zeros(0, 2, dtype=torch.long), torch.zeros(0), [], 0.0),
                     (1, torch.tensor([[0, 1], [2, 5], [2, 6]]), torch.tensor([1.0, 2.0, 3.0]),
                      [(0, None, 0, 8, 0.1, [1]), (2, 7, 5, 7, 0.9, [5, 6])], 0.95)])
    return out


def test_terms_rows_and_pieces_are_numbered_rank_by_rank():
    g = terms_of_two_ranks()
    assert g.rows == [(0, 0, 1), (1, 1, 0), (1, 1, 2)]
    assert g.score == {(0, 0, 3): 0.5, (0, 0, 4): 0.25, (0, 1, 1): 1.0, (0, 2, 5): 2.0, (0, 2, 6): 3.0}
    assert g.dist_terms() == [(0, 0, 1, 3), (0, 0, 1, 4), (1, 1, 0, 1), (1, 1, 2, 5), (1, 1, 2, 6)]
    assert g.to_dist([(2, 6), (0, 3)]) == [(1, 1, 2, 6), (0, 0, 1, 3)] and g.of_dist((1, 1, 2, 5)) == (2, 5)
    assert g.pieces == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert g.piece_terms == [[(0, 3), (0, 4)], [], [], [(1, 1), (2, 5), (2, 6)]]
    assert g.piece_norms == [0.7, 0.0, 0.0, 0.95]
    seg = g.segments.items[-1]
    assert (seg.micro_batch, seg.batch, seg.document, seg.start, seg.end) == (0, 2, 7, 5, 7)
    assert seg.terms == [(2, 5), (2, 6)]
    assert g.segments.norms() == [0.7, 0.1, 0.9]


def test_rows_found_on_global_terms_are_placed_on_their_rank():
    g = terms_of_two_ranks()
    sample = g.place(Culprit("sample", 1.0, 0.5, micro_batch=0, batch=2, start=5, end=7, document=7), labelled=True)
    assert (sample.rank, sample.micro_batch, sample.batch, sample.document) == (1, 1, 2, 7)
    token = g.place(CulpritToken(batch=0, position=3, grad_norm=1.0), labelled=False)
    assert (token.rank, token.micro_batch, token.batch, token.position) == (0, None, 1, 3)
    piece = g.place_piece(Culprit("micro_batch", 1.0, 0.9, micro_batch=3))
    assert (piece.rank, piece.micro_batch, piece.batch) == (1, 1, None) and g.piece_of(piece) == 3
    share = g.place_share({"micro_batch": 0, "sample": 1, "document": None, "share": 0.2, "grad_norm": 1.0}, True)
    assert (share["rank"], share["micro_batch"], share["sample"]) == (1, 1, 0)
