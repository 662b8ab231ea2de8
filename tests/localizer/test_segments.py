"""Exact per-segment gradient norms from one backward (``localizer/segments.py``): the Gram form,
the explicit per-segment gradient and the embedding's per-(segment, id) sums all give each
segment's squared weight (+ bias) gradient norm; against a brute-force sum per segment, for
rows and for documents packed in rows. The ghost pass hands the output head's per-term map to
the segments (windows are chosen on it)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gradloc_track.localizer.ghost import GhostMap
from gradloc_track.localizer.segments import Segments

from .oracles import grads_of, norm, term_mask, tiny_gpt

B, T, C_IN, C_OUT = 3, 10, 5, 4


def packed() -> torch.Tensor:
    docs = torch.zeros(B, T, dtype=torch.long)
    docs[1, 4:7], docs[1, 7:] = 1, 2  # row 1 packs three documents
    docs[2, 5:] = 3
    return docs


def brute(segs: Segments, g: torch.Tensor, x: torch.Tensor, kind: str, bias: bool) -> list[float]:
    """Each segment's gradient, summed position by position: a linear layer's ``sum_t g_t x_t^T``
    (+ ``sum_t g_t``), an embedding's rows ``sum_{t: id_t = v} g_t``."""
    out = []
    for s in segs.items:
        pos = [(b, t) for b in range(B) for t in range(T) if int(segs.ids[b, t]) == segs.items.index(s)]
        if kind == "embedding":
            rows = {}
            for b, t in pos:
                rows[int(x[b, t])] = rows.get(int(x[b, t]), 0) + g[b, t].double()
            out.append(sum(float(r.pow(2).sum()) for r in rows.values()))
            continue
        w = sum(torch.outer(g[b, t].double(), x[b, t].double()) for b, t in pos)
        sq = float(w.pow(2).sum())
        if bias:
            sq += float(sum(g[b, t].double() for b, t in pos).pow(2).sum())
        out.append(sq)
    return out


@pytest.mark.parametrize("docs", [None, packed()], ids=["rows", "packed-documents"])
@pytest.mark.parametrize("form", ["_add_gram", "_add_explicit"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_both_linear_forms_are_exact(docs, form, bias):
    g = torch.randn(B, T, C_OUT, generator=torch.Generator().manual_seed(1))
    x = torch.randn(B, T, C_IN, generator=torch.Generator().manual_seed(2))
    segs = Segments(0, torch.ones(B, T), docs)
    segs.sq = torch.zeros(len(segs), dtype=torch.float64)
    getattr(segs, form)(g, x, bias)
    assert segs.sq.tolist() == pytest.approx(brute(segs, g, x, "linear", bias), rel=1e-5)


@pytest.mark.parametrize("docs", [None, packed()], ids=["rows", "packed-documents"])
def test_the_embedding_sums_positions_of_the_same_id_per_segment(docs):
    g = torch.randn(B, T, C_OUT, generator=torch.Generator().manual_seed(3))
    ids = torch.randint(0, 4, (B, T), generator=torch.Generator().manual_seed(4))  # repeats within rows
    segs = Segments(0, torch.ones(B, T), docs)
    segs.add(g, ids, "embedding", False)
    assert segs.sq.tolist() == pytest.approx(brute(segs, g, ids, "embedding", False), rel=1e-5)


def test_the_cheaper_form_is_taken_and_a_real_backward_agrees():
    """Long rows through small layers take the explicit form; the segment norms of one ghost
    backward equal a backward per document over the hooked layers, and the head's map is exact
    per term (the output head's own contribution ``||g_t|| ||x_t||``)."""
    V, L = 32, 40
    model = tiny_gpt(V, L)
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, V, (2, L), generator=gen), torch.randint(0, V, (2, L), generator=gen)
    docs = torch.zeros(2, L, dtype=torch.long)
    docs[1, 15:] = 1

    def loss_fn(mask):
        per = F.cross_entropy(model(x).reshape(-1, V), y.reshape(-1), reduction="none").view(2, L)
        return (per * mask).sum() / (2 * L)

    segs = Segments(0, torch.ones(2, L), docs)
    called = []
    explicit = segs._add_explicit
    segs._add_explicit = lambda *a: called.append(1) or explicit(*a)
    with GhostMap(model, "block", (2, L), segments=segs):
        model.zero_grad(set_to_none=True)
        loss_fn(torch.ones(2, L)).backward()
    assert called  # d=32 layers over 40 positions: the explicit form is cheaper than the Gram one
    hooked = [p for n, p in model.named_parameters() if "ln" not in n and "wpe" not in n]
    for seg, got in zip(segs.items, segs.norms()):
        mask = term_mask((2, L), seg.terms)
        # attention is not masked per document here: only the row holding one document is exact
        if seg.batch == 0:
            assert got == pytest.approx(norm(torch.autograd.grad(loss_fn(mask), hooked)), rel=1e-5)
    head = segs.head.sqrt()
    for b, t in [(0, 3), (1, 20)]:
        want = norm(grads_of(model, loss_fn(term_mask((2, L), [(b, t)])))[-1:])  # lm_head.weight only
        assert float(head[b, t]) == pytest.approx(want, rel=1e-4)
    model.zero_grad(set_to_none=True)
