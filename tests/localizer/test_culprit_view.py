"""One culprit, one name: the console, the cause's sentence, the highlight page, the events table's share
summary and the localizer's notes name a unit with ``units``/``CulpritView``, and read its text and
columns from one host-side view of the batch (``CulpritView``), per micro-batch or flat alike."""
from __future__ import annotations

import html
import re

import torch

from gradloc_track.artifacts.events import known_norms
from gradloc_track.artifacts.highlight import render_highlight_html
from gradloc_track.artifacts.table import attribution_table
from gradloc_track.console import SpikeView, culprit_lines
from gradloc_track.localizer.culprit_view import CulpritView
from gradloc_track.localizer.nonfinite_words import label
from gradloc_track.localizer.result import Culprit, CulpritToken, LocateResult
from gradloc_track.monitor.cause_evidence import evidence_of
from gradloc_track.spikes import SpikeContext
from gradloc_track.spikes.event import SpikeEvent
from gradloc_track.units import row_label, share_list, unit_label

EVENT = SpikeEvent(7, "global", 9.0, 1.0, 30.0, 9.0)


class Letters:
    def decode(self, ids):
        return "".join(chr(ord("a") + int(i) % 26) for i in ids)


def two_micro_batches() -> tuple[LocateResult, SpikeContext]:
    """Micro-batch 1, row 1 packs documents 0 (positions 0-5) and 1 (6-11); document 1 is the culprit,
    and micro-batch 0's row 0 holds a culprit token at position 3 (document 0)."""
    B, T = 2, 12
    ids = [torch.arange(B * T).view(B, T) % 26, (torch.arange(B * T).view(B, T) + 5) % 26]
    masks = [torch.ones(B, T), torch.ones(B, T)]
    masks[1][1, 6] = 0.0  # a position without a loss term: not part of the document's text
    docs = [torch.tensor([[0] * 6 + [1] * 6] * B)] * 2
    ctx = SpikeContext([lambda m: m.sum()] * 2, masks, input_ids=ids, tokenizer=Letters(), document_ids=docs,
                       sample_columns={"source": [torch.tensor([10, 11]), torch.tensor([20, 21])]},
                       extra_columns={"ratio": [torch.full((B, T), 2.0), torch.arange(B * T).view(B, T).float()]})
    doc = Culprit("sample", 3.0, 0.8, micro_batch=1, batch=1, start=6, end=12, document=1, n_terms=5)
    tok = CulpritToken(0, 3, grad_norm=1.0, share=0.15, micro_batch=0)
    return LocateResult([tok], 6, "auto", 0.1, 3.5, culprits=[doc, tok]), ctx


def test_unit_label_is_the_one_phrase():
    assert unit_label(3) == "sample 3"
    assert unit_label(3, micro_batch=1) == "micro-batch 1, sample 3"
    assert unit_label(0, document=2) == "document 2 (sample 0)"
    assert unit_label(3, 0, 2, rank=1) == "document 2 (rank 1, micro-batch 0, sample 3)"
    assert label(0, 1, 2) == unit_label(0, 1, 2)  # the non-finite search's sentences
    assert row_label({"sample": 4, "micro_batch": 1, "document": None}) == "micro-batch 1, sample 4"
    assert row_label({"sample": 9, "group": 1, "index": 2, "reward": 0.25}) == \
        "completion 2 of group 1, reward 0.25 (sample 9)"
    assert share_list([{"sample": 3, "micro_batch": None, "share": 0.21}, {"sample": 1, "share": None}]) == \
        "sample 3 21%"


def test_a_culprit_reads_the_same_in_every_reader():
    result, ctx = two_micro_batches()
    view = CulpritView(result, ctx)
    doc, tok = result.culprits
    assert view.per_mb
    assert view.who(1, 1, 1) == ("document 1 (micro-batch 1, sample 1)", "document")
    assert view.words(doc) == "document 1 (micro-batch 1, sample 1)"
    assert view.words(tok) == "document 0 (micro-batch 0, sample 0), token 3"
    assert view.terms(doc) == [7, 8, 9, 10, 11]  # position 6 has no loss term
    row = ((torch.arange(24).view(2, 12) + 5) % 26)[1].tolist()
    assert view.text_at(1, 1, view.terms(doc)) == Letters().decode([row[p] for p in range(7, 12)])
    assert view.mean_of("ratio", 1, 1, view.terms(doc)) == sum(12 + p for p in range(7, 12)) / 5

    lines = culprit_lines(SpikeView(7, [EVENT], result, ctx))
    assert lines[0].startswith(f"{view.words(doc)}, the whole document: '{view.text_at(1, 1, view.terms(doc))}'")
    assert lines[1].startswith(f"{view.words(tok)}: 'd'")

    ev = evidence_of([EVENT], result, view, (None, None))
    assert ev.top_culprit == view.words(doc)

    page = render_highlight_html(7, [EVENT], result, ctx, window=2)
    headings = [html.unescape(h) for h in re.findall(r"<h2>([^<]*)</h2>", page)]
    assert headings == ["document 0 (micro-batch 0, sample 0)", view.words(doc)]  # the token's one document

    columns, rows = attribution_table(7, [EVENT], result, ctx)
    cells = [dict(zip(columns, r)) for r in rows]
    assert [(c["micro_batch"], c["sample"], c["document"]) for c in cells] == [(1, 1, 1), (0, 0, 0)]
    assert [row_label(c) for c in cells] == ["document 1 (micro-batch 1, sample 1)",
                                            "document 0 (micro-batch 0, sample 0)"]
    assert cells[0]["token"] == view.text_at(1, 1, view.terms(doc))
    assert cells[0]["ratio"] == view.mean_of("ratio", 1, 1, view.terms(doc)) and cells[1]["ratio"] == 2.0
    assert [c["source"] for c in cells] == [21, 10]


def test_a_gathered_view_is_one_flat_batch_whatever_micro_batch_its_culprits_name():
    """Under torch.distributed rank 0's view stacks every culprit's row: the culprit keeps its rank's
    micro-batch, the view indexes its own rows, and the name is the rank's sample."""
    ids = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    ctx = SpikeContext(lambda m: m.sum(), torch.ones(2, 4), input_ids=ids, tokenizer=Letters(),
                       sample_columns={"rank": torch.tensor([0, 1]), "rank_sample": torch.tensor([3, 6])})
    c = Culprit("sample", 1.0, 0.9, micro_batch=2, batch=1, start=0, end=4, n_terms=4, rank=1)
    view = CulpritView(LocateResult([], 4, "auto", 0.1, 1.0, culprits=[c]), ctx)
    assert not view.per_mb
    assert view.words(c) == "rank 1, micro-batch 2, sample 6"
    assert view.text_at(2, 1, view.terms(c)) == "fghi"


def test_without_a_context_a_culprit_is_named_by_its_coordinates():
    c = CulpritToken(4, 17, grad_norm=1.0, share=0.5, micro_batch=1, rank=2)
    assert CulpritView(None, None).words(c) == "rank 2, micro-batch 1, sample 4, token 17"
    span = Culprit("span", 1.0, 0.5, batch=0, start=3, end=9, n_terms=6)
    assert CulpritView(None, None).words(span) == "sample 0, span 3-8"
    assert known_norms(LocateResult([], 1, "auto", 0.1, 1.0, sample_shares=[
        {"micro_batch": 1, "sample": 2, "document": None, "share": 0.4}]))[1] == "micro-batch 1, sample 2 40%"
