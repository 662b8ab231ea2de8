"""The highlight page: windows around culprits, padding, escaping, a bounded page at any batch size;
a culprit sample named and outlined across micro-batches."""
from __future__ import annotations

import html
import re

import pytest
import torch

from gradloc_track.artifacts import attribution_table, render_highlight_html
from gradloc_track.artifacts.highlight import CSS, MAX_SAMPLES, MAX_TOKEN_CHARS
from gradloc_track.demo.data import ByteTokenizer
from gradloc_track.localizer.result import CulpritToken, LocateResult
from gradloc_track.spikes import SpikeContext, SpikeEvent

from .cases import DOC, T_LEVELS, levels_case, make_case


def visible_text_div(page: str, sample: int) -> str:
    m = re.search(rf"<h2>sample {sample}</h2><div class='meta'>[^<]*</div><div class='text'>(.*?)</div><table>", page)
    assert m, f"no text block for sample {sample}"
    return m.group(1)


def test_long_sequence_shows_one_window_per_culprit_and_the_full_text_collapsed():
    events, result, ctx = make_case()
    page = render_highlight_html(12, events, result, ctx, window=10)
    shown = visible_text_div(page, 1)
    titles = [int(t) for t in re.findall(r'title="position (\d+) \|', shown)]
    # exactly the two windows [30, 50] and [510, 530]; everything else elided with a count
    assert titles == list(range(30, 51)) + list(range(510, 531))
    gaps = [int(n) for n in re.findall(r"\u2026 (\d+) tokens \u2026", shown)]
    assert gaps == [30, 510 - 51, 600 - 531]
    # the full text is collapsible, with every position once (padding collapsed into one marker)
    full = re.search(r"<details><summary>full text \(600 tokens\)</summary><div class='text'>(.*?)</div></details>",
                     page).group(1)
    assert [int(t) for t in re.findall(r'title="position (\d+) \|', full)] == list(range(560))
    assert "positions 560-599: 40 x token id 0, no loss term" in full and "\u00d740" in full
    assert "sample 0" not in page  # no culprit there


def test_culprit_spans_carry_text_and_numbers_as_in_the_table():
    events, result, ctx = make_case()
    page = render_highlight_html(12, events, result, ctx, window=5)
    cols, rows = attribution_table(12, events, result, ctx)
    shown = visible_text_div(page, 1)
    spans = re.findall(r'<span class="t c"[^>]*title="([^"]*)">([^<]*)</span>', shown)
    assert len(spans) == len(rows) == 2
    for (title, text), row in zip(spans, rows):
        r = dict(zip(cols, row))
        assert html.unescape(text) == r["token"]
        t = html.unescape(title)
        assert f"position {r['position']} " in t and f"token id {r['token_id']} " in t
        assert f"grad norm {r['grad_norm']:.3e}" in t and f"share {r['share']:.3f}" in t
        assert r["top_layers"] in t and r["top_layers"].startswith("lm_head:")
    # log colour ramp: the stronger culprit is the most intense colour, background tokens fainter
    alphas = {int(p): float(a) for a, p in re.findall(r'rgba\(255,80,0,([\d.]+)\)" title="position (\d+) ', shown)}
    assert alphas[40] == 1.0 and alphas[520] < 1.0 and alphas[41] < alphas[520]


def test_culprit_tokens_are_coloured_by_their_exact_norms_not_their_ghost_scores():
    """Held-out tester, stop 64: the ghost norm leaves the embeddings out, and the page drew the culprit with share
    0.66 lighter than the one with share 0.34 while the cause line and the table named it the largest. A culprit
    token's colour is its exact norm now; the others keep their ghost scores, on one scale."""
    import dataclasses

    events, result, ctx = make_case()
    first, second = result.tokens  # ghost 10 and 1; exact 5 and 2.5
    result.tokens = [first, dataclasses.replace(second, grad_norm=8.0)]  # the exact order turned round
    result.culprits = [c if c is not second else result.tokens[1] for c in result.culprits]
    shown = visible_text_div(render_highlight_html(12, events, result, ctx, window=5), 1)
    alphas = {int(p): float(a) for a, p in re.findall(r'rgba\(255,80,0,([\d.]+)\)" title="position (\d+) ', shown)}
    assert alphas[520] == 1.0 and alphas[40] < alphas[520] and alphas[41] < alphas[40]
    assert "a culprit token's exact gradient norm, elsewhere the position's ghost norm" in shown or \
        "a culprit token's exact gradient norm" in render_highlight_html(12, events, result, ctx, window=5)


def test_culprit_tokens_without_a_ghost_map_are_coloured_by_their_exact_norms(tmp_path):
    """Review, stop 64: with no ghost map (``method=gradloc``) the colour range was empty and every culprit was drawn
    at full colour, whatever its exact norm."""
    import dataclasses

    events, result, ctx = make_case()
    first, second = result.tokens
    result.tokens = [dataclasses.replace(first, grad_norm=50.0), dataclasses.replace(second, grad_norm=2.0)]
    result.culprits = [result.tokens[0] if c is first else result.tokens[1] if c is second else c
                       for c in result.culprits]
    result.ghost_map = None
    shown = visible_text_div(render_highlight_html(12, events, result, ctx, window=5), 1)
    alphas = {int(p): float(a) for a, p in re.findall(r'rgba\(255,80,0,([\d.]+)\)" title="position (\d+) ', shown)}
    assert alphas[40] == 1.0 and alphas[520] == 0.0  # the range runs from the smaller exact norm to the larger


def test_invisible_and_bidi_characters_are_shown_as_escapes():
    class Tok:
        def decode(self, ids):
            return {1: "a\u202eb", 2: "\x00", 3: "\u200b", 4: "", 5: "x\ty\r\n"}.get(ids[0], "z")

    events, result, ctx = make_case(T=40, culprits=((0, 3),), pad_from=40)
    ctx.input_ids[0, :6] = torch.tensor([1, 2, 3, 4, 5, 6])
    ctx.tokenizer = Tok()
    page = render_highlight_html(12, events, result, ctx)
    for raw in ("\u202e", "\u200b", "\x00", "\t", "\r"):
        assert raw not in page
    for shown in (r"a\u202eb", r"\x00", r"\u200b", "\u2205", "x\u2192y\u240d\u21b5\n"):
        assert shown in page


def test_bad_arguments_name_the_fix():
    events, result, ctx = make_case(T=40, culprits=((0, 3),), pad_from=40)
    with pytest.raises(ValueError, match="input_ids"):
        render_highlight_html(12, events, result, SpikeContext(ctx.loss_fn, ctx.token_mask))
    with pytest.raises(ValueError, match="window=-1"):
        render_highlight_html(12, events, result, ctx, window=-1)


def test_a_window_ending_in_padding_runs_to_the_end_of_the_padding():
    events, result, ctx = make_case(culprits=((1, 555),), pad_from=560)
    page = render_highlight_html(12, events, result, ctx, window=10)
    shown = visible_text_div(page, 1)
    assert [int(t) for t in re.findall(r'title="position (\d+) \|', shown)] == list(range(545, 560))
    assert "positions 560-599: 40 x token id 0" in shown
    assert re.findall(r"\u2026 (\d+) tokens \u2026", shown) == ["545"]  # only the leading gap
    assert "positions 545\u2013599 of 600" in page


class HugeTokens:
    """Token 7 decodes to 10k characters (a minified blob), token 8 to a script tag; the rest to 'w'."""

    def decode(self, ids):
        i = int(ids[0])
        return "A" * 10_000 if i == 7 else ("<script>alert(1)</script>" if i == 8 else f"w{i % 10} ")


def test_page_at_b32_t2048_with_10k_char_tokens_is_bounded_and_escaped():
    B, T = 32, 2048
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 100, (B, T), generator=g)
    ids[:, ::50] = 7
    ids[:, 3::50] = 8
    ghost = torch.rand(B, T, generator=g)
    toks = [CulpritToken(b, (37 * b) % T, grad_norm=1.0 + b, score=1.0, share=0.01, layer_norms={"h.0": 1.0})
            for b in range(B)]
    result = LocateResult(toks, probes=40, method="bisect", threshold=0.5, total_norm=3.0, layer_names=["h.0"],
                          ghost_map=ghost, layer_map=ghost[None])
    ctx = SpikeContext(lambda m: m.sum(), torch.ones(B, T), input_ids=ids, tokenizer=HugeTokens())
    page = render_highlight_html(5, [SpikeEvent(5, "global", 3.0, 1.0, 9.0, 3.0)], result, ctx, window=48)
    assert len(page.encode()) < 2 * 2**20, f"{len(page.encode()) / 2**20:.1f} MiB"
    assert "A" * (MAX_TOKEN_CHARS + 1) not in page and f"[+{10_000 - MAX_TOKEN_CHARS} chars]" in page
    assert "<script" not in page.lower() and "&lt;script&gt;" in page
    assert len(re.findall(r"<h2>sample (\d+)</h2>", page)) == MAX_SAMPLES
    # the samples shown are those with the largest culprits
    assert {int(s) for s in re.findall(r"<h2>sample (\d+)</h2>", page)} == set(range(B - MAX_SAMPLES, B))
    assert f"{B - MAX_SAMPLES} more sample(s) with culprits" in page


def test_adjacent_culprit_outlines_take_layout_space():
    """A border (not an outline) cannot overlap the neighbouring token or clip its glyph."""
    rule = re.search(r"\.c\{([^}]*)\}", CSS).group(1)
    assert "outline" not in rule and "border:2px" in rule and "margin:0 1px" in rule


def test_html_highlights_the_culprit_and_runs_nothing(spike):
    events, result, ctx = spike
    page = render_highlight_html(7, events, result, ctx, window=8)
    assert "<script" not in page.lower() and "javascript:" not in page.lower()
    assert not re.search(r"(href|src)\s*=", page), "no external links or resources"
    assert "&lt;script&gt;alert(1)&lt;/script&gt;&quot;&#x27;&amp;" in page
    culprit = re.findall(r'<span class="t c"[^>]*title="([^"]*)"[^>]*>([^<]*)</span>', page)
    assert culprit and all("CULPRIT" in t and "position 30" in t for t, _ in culprit)
    assert culprit[0][1].startswith("&lt;script&gt;")
    assert "step 7" in page and "h.1" in page and "9.50" in page
    assert "<details>" in page  # the window is short: the full text is collapsible


def test_newlines_are_visible_not_swallowed(spike):
    events, result, ctx = spike
    page = render_highlight_html(7, events, result, ctx, window=60)
    assert "\u21b5" in page  # the newline token is shown, not swallowed
    assert "sample 2" in page and "sample 0" not in page


def test_segments_show_each_part_in_its_own_block_with_sample_columns():
    """``segment_ids``: an RL sample's prompt and completion as blocks of their own (names escaped), the
    sample's own columns (reward, group) under its heading; -1 positions (padding) are not shown."""
    events, result, ctx = make_case(T=60, culprits=((1, 40),), pad_from=58)
    seg = torch.zeros(2, 60, dtype=torch.long)
    seg[:, 30:] = 1
    seg[:, :5] = -1  # left padding
    ctx.segment_ids, ctx.segment_names = seg, ("prompt <p>", "completion")
    ctx.sample_columns = {"reward": torch.tensor([0.5, -0.25]), "group": torch.tensor([0, 3])}
    page = render_highlight_html(12, events, result, ctx, window=4)
    sample1 = page.split("<h2>sample 1</h2>")[1]
    assert "reward <b>-0.25</b> · group <b>3</b>" in sample1
    prompt, completion = sample1.split("<b>completion</b>")
    assert "<b>prompt &lt;p&gt;</b> · positions 5\u201329" in prompt and "prompt <p>" not in page
    assert [int(t) for t in re.findall(r'title="position (\d+) \|', prompt)] == list(range(5, 30))  # whole prompt
    shown = [int(t) for t in re.findall(r'title="position (\d+) \|', completion)]
    assert shown[:9] == list(range(36, 45)) and "1 culprit token(s)" in completion  # a window around 40


def test_documents_without_culprits_are_named_not_shown():
    events, result, ctx = make_case(T=60, culprits=((1, 40),), pad_from=60)
    docs = torch.tensor([0] * 20 + [1] * 15 + [2] * 25).expand(2, 60).clone()
    ctx.segment_ids = docs  # no names: packed documents
    page = render_highlight_html(12, events, result, ctx, window=3)
    sample1 = page.split("<h2>sample 1</h2>")[1]
    assert "document 0 · 20 tokens, no culprit" in sample1 and "document 1 · 15 tokens, no culprit" in sample1
    assert "<b>document 2</b> · positions 35\u201359 · 1 culprit token(s)" in sample1
    shown = [int(t) for t in re.findall(r'title="position (\d+) \|', sample1.split("<table>")[0])]
    assert shown == list(range(37, 44))


def test_highlight_page_names_and_outlines_the_sample_across_micro_batches():
    events, result, ctx = levels_case()
    page = render_highlight_html(12, events, result, ctx, window=4)
    assert "<script" not in page.lower() and "<b>garbage" not in page  # the document's markup stays text
    sec = re.search(r"<h2>micro-batch 1, sample 1</h2><div class='meta'>reward <b>1</b></div>"
                    r"<div class='meta'>([^<]*)</div><div class='text'>(.*?)</div>", page)  # its columns, then units
    assert sec and "culprit whole sample: 23 loss terms at positions 0\u201323 of 24" in html.unescape(sec.group(1))
    # said once (the window is the unit), and no token table without culprit tokens (round 8: twice, and empty)
    assert html.unescape(sec.group(1)).count("positions 0\u201323") == 1
    doc_section = page[sec.start():page.index("<h2>", sec.end()) if "<h2>" in page[sec.end():] else len(page)]
    assert "<table>" not in doc_section
    tokens_section = page[page.index("<h2>micro-batch 0, sample 0</h2>"):]
    assert "<table><tr><th>position</th>" in tokens_section[:tokens_section.index("<h2>", 4)]
    unit = re.search(r'<span class="u" title="CULPRIT sample[^"]*">', sec.group(2))
    inside = sec.group(2)[unit.end():]
    assert DOC[: T_LEVELS - 1].decode() in html.unescape(re.sub(r"<[^>]+>", "", inside))  # its text, in the outline
    assert re.search(r"<h2>micro-batch 0, sample 0</h2>", page) and '<span class="t c"' in page
    assert "<h2>micro-batch 2</h2>" in page and "culprit micro-batch" in page
    assert "a note from the localizer" in page
    assert "culprits: 1 sample, 1 micro-batch, 2 tokens" in page


def test_a_whole_sample_named_by_its_answer_shows_the_prompt_before_it():
    """A sample spans its loss terms (an SFT answer at 40-59, its prompt masked): its section shows the prompt's
    last ``window`` tokens before the answer, the text a reader judges the answer by, and says the positions are
    its loss terms' (review of 296eda0: 8 tokens of the prompt, and "whole sample: positions 40-59")."""
    from gradloc_track.localizer.result import Culprit

    text = ("Q: what does the fox do? A: " * 4).encode()[:64]
    ids = torch.tensor([list(text), list(text)])
    mask = torch.zeros(2, 64)
    mask[1, 40:60] = 1.0
    unit = Culprit("sample", 2.0, 0.9, batch=1, start=40, end=60, n_terms=20)
    result = LocateResult([], probes=3, method="auto", threshold=0.25, total_norm=2.0, culprits=[unit])
    ctx = SpikeContext(lambda m: m.sum(), mask, input_ids=ids, tokenizer=ByteTokenizer())
    page = html.unescape(render_highlight_html(12, [SpikeEvent(12, "global", 6.0, 1.2, 8.0, 5.0)], result, ctx,
                                               window=24))
    assert "culprit whole sample: 20 loss terms at positions 40\u201359 of 64" in page
    section = page.split("<h2>sample 1</h2>")[1].split("<table>")[0]
    shown = [int(t) for t in re.findall(r'title="position (\d+) \|', section)]
    assert shown[0] == 16 and shown[-1] >= 59
