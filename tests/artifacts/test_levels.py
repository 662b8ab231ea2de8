"""Culprits at every level in the table, the highlight page, the console block and the report.

Constructed results over two micro-batches of byte text: a culprit SAMPLE (a whole document, in
micro-batch 1), culprit TOKENS (micro-batch 0), a culprit MICRO-BATCH; every view names the
micro-batch and sample and shows a unit's text, escaped.
"""
from __future__ import annotations

import html
import io
import re

import torch

from gradloc_track.artifacts import attribution_table, render_highlight_html
from gradloc_track.demo.console import TrainConsole
from gradloc_track.demo.data import ByteTokenizer
from gradloc_track.localizer.result import Culprit, CulpritToken, LocateResult
from gradloc_track.report import culprit_counts
from gradloc_track.spikes import SpikeContext, SpikeEvent

T = 24
DOC = b"<b>garbage & more</b>..."[:T]  # hostile markup: must come out escaped
TEXT = b"the quick brown fox jumps over the lazy dog"


def case():
    ids = [torch.tensor([list(TEXT[:T]), list(TEXT[5:5 + T])]), torch.tensor([list(TEXT[9:9 + T]), list(DOC)])]
    masks = [torch.ones(2, T), torch.ones(2, T)]
    masks[1][1, -1] = 0.0  # the document's last position has no loss term
    doc = Culprit("sample", 2.0, 0.6, micro_batch=1, batch=1, start=0, end=T, n_terms=T - 1,
                  layer_norms={"h.0": 1.5, "lm_head": 1.0})
    mb = Culprit("micro_batch", 0.5, 0.1, micro_batch=2, n_terms=48)
    toks = [CulpritToken(0, p, grad_norm=1.0, share=0.1, layer_norms={"h.0": 0.5}, micro_batch=0) for p in (4, 5)]
    ghost = [torch.full((2, T), 1e-3), torch.full((2, T), 1e-3), None]
    result = LocateResult(toks, probes=9, method="auto", threshold=0.3, total_norm=3.0, layer_names=["h.0"],
                          micro_batch_norms=[1.0, 2.0, 0.5], ghost_maps=ghost, layer_maps=[None] * 3,
                          culprits=[doc, mb] + toks, notes=["a note from the localizer"])
    ctx = SpikeContext(loss_fn=[lambda m: m.sum()] * 3, token_mask=masks + [torch.ones(2, T)],
                       input_ids=ids + [ids[0]], tokenizer=ByteTokenizer(),
                       sample_columns={"reward": [torch.tensor([0.0, 1.0])] * 3})
    return [SpikeEvent(12, "global", 6.0, 1.2, 8.0, 5.0)], result, ctx


def test_table_has_a_row_per_culprit_at_its_level_with_the_units_text():
    events, result, ctx = case()
    cols, rows = attribution_table(12, events, result, ctx)
    assert cols[:3] == ["step", "level", "micro_batch"] and "end" in cols and cols[-1] == "reward"
    got = [dict(zip(cols, r)) for r in rows]
    assert [(r["level"], r["micro_batch"], r["sample"], r["position"], r["end"]) for r in got] == [
        ("sample", 1, 1, 0, T), ("micro_batch", 2, None, None, None), ("token", 0, 0, 4, 5), ("token", 0, 0, 5, 6)]
    doc, mb, tok = got[0], got[1], got[2]
    assert doc["token"] == DOC[: T - 1].decode() and doc["token_id"] is None  # its loss terms' text
    assert doc["share"] == 0.6 and doc["reward"] == 1.0 and doc["top_layers"].startswith("h.0:")
    assert mb["token"] == "" and mb["reward"] is None
    assert tok["token"] == chr(TEXT[4]) and tok["token_id"] == TEXT[4] and tok["reward"] == 0.0


def test_highlight_page_names_and_outlines_the_sample_across_micro_batches():
    events, result, ctx = case()
    page = render_highlight_html(12, events, result, ctx, window=4)
    assert "<script" not in page.lower() and "<b>garbage" not in page  # the document's markup stays text
    sec = re.search(r"<h2>micro-batch 1 · sample 1</h2><div class='meta'>reward <b>1</b></div>"
                    r"<div class='meta'>([^<]*)</div><div class='text'>(.*?)</div>", page)  # its columns, then units
    assert sec and "culprit whole sample: positions 0\u201323 of 24" in html.unescape(sec.group(1))
    unit = re.search(r'<span class="u" title="CULPRIT sample[^"]*">', sec.group(2))
    inside = sec.group(2)[unit.end():]
    assert DOC[: T - 1].decode() in html.unescape(re.sub(r"<[^>]+>", "", inside))  # its text, in the outline
    assert re.search(r"<h2>micro-batch 0 · sample 0</h2>", page) and '<span class="t c"' in page
    assert "<h2>micro-batch 2</h2>" in page and "culprit micro-batch" in page
    assert "a note from the localizer" in page
    assert "culprits: 1 sample, 1 micro-batch, 2 tokens" in page


def test_console_block_names_the_sample_and_the_micro_batch(tmp_path):
    events, result, ctx = case()
    out = io.StringIO()
    TrainConsole(stream=out).spike(12, events, result, ByteTokenizer(), ctx.input_ids, tmp_path)
    text = out.getvalue()
    assert "micro-batch 1, sample 1, the whole sample: '<b>garbage & more</b>" in text and "(60% of" in text
    assert "micro-batch 2: the whole micro-batch (no sample or token in it stands out)" in text
    assert "micro-batch 0, sample 0, positions 4-5" in text


def test_console_block_without_culprits_gives_the_per_sample_shares(tmp_path):
    result = LocateResult([], probes=6, method="auto", threshold=0.3, total_norm=3.0,
                          sample_shares=[{"micro_batch": None, "sample": 3, "document": None, "share": 0.21,
                                          "grad_norm": 1.0}])
    out = io.StringIO()
    TrainConsole(stream=out).spike(12, [], result, None, torch.zeros(4, T, dtype=torch.long), tmp_path)
    assert "none found: no sample, span or token stands out" in out.getvalue()
    assert "largest per-sample shares: sample 3 21%" in out.getvalue()


def test_report_counts_culprits_by_level():
    table = {"columns": ["step", "level", "token"], "data": [[1, "sample", "x"], [1, "token", "y"], [2, "token", "z"]]}
    assert culprit_counts(table) == "1 culprit sample(s), 2 culprit token(s)"
    assert culprit_counts({"columns": ["step", "token"], "data": [[1, "y"]]}) == "1 culprit token(s)"  # 0.2 tables
