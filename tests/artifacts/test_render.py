"""Renderers on constructed localization results: windows, padding, escaping, heatmap size."""
from __future__ import annotations

import html
import re
import struct
import warnings

import pytest
import torch

from gradloc_track.artifacts import attribution_table, render_highlight_html, render_layer_heatmap
from gradloc_track.artifacts import heatmap as heatmap_mod
from gradloc_track.demo.data import ByteTokenizer
from gradloc_track.localizer.result import CulpritToken, LocateResult
from gradloc_track.spikes import SpikeContext, SpikeEvent

LAYERS = ["wte", "h.0", "h.1", "lm_head"]


def make_case(T=600, culprits=((1, 40), (1, 520)), pad_from=560):
    """Two samples of text; sample 1 has two culprits far apart and trailing padding (id 0, no loss)."""
    text = ("The quick brown fox jumps over the lazy dog. " * 20).encode()
    ids = torch.tensor([list(text[:T]), list(text[7:7 + T])])  # (B, T)
    mask = torch.ones(2, T)
    ids[1, pad_from:] = 0
    mask[1, pad_from:] = 0.0
    ghost = torch.full((2, T), 1e-3)  # (B, T)
    layer_map = torch.full((len(LAYERS), 2, T), 1e-4)  # (L, B, T)
    toks = []
    for k, (b, p) in enumerate(culprits):
        ghost[b, p] = 10.0 ** (1 - k)
        layer_map[:, b, p] = torch.tensor([0.1, 2.0, 0.5, 3.0]) / (k + 1)
        toks.append(CulpritToken(b, p, grad_norm=5.0 / (k + 1), score=float(ghost[b, p]), share=0.6 - 0.2 * k,
                                 layer_norms=dict(zip(LAYERS, layer_map[:, b, p].tolist()))))
    result = LocateResult(toks, probes=9, method="auto", threshold=0.25, total_norm=6.0, layer_names=LAYERS,
                          ghost_map=ghost, layer_map=layer_map)
    ctx = SpikeContext(lambda m: m.sum(), mask, input_ids=ids, tokenizer=ByteTokenizer())
    events = [SpikeEvent(12, "global", 6.0, 1.2, 8.0, 5.0)]
    return events, result, ctx


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


def test_without_tokenizer_ids_are_shown_escaped():
    events, result, ctx = make_case(T=40, culprits=((0, 3),), pad_from=40)
    ctx.tokenizer = None
    cols, rows = attribution_table(12, events, result, ctx)
    tid = int(ctx.input_ids[0, 3])
    assert dict(zip(cols, rows[0]))["token"] == f"<{tid}>"
    assert f"&lt;{tid}&gt;" in render_highlight_html(12, events, result, ctx)


def test_bad_arguments_name_the_fix():
    events, result, ctx = make_case(T=40, culprits=((0, 3),), pad_from=40)
    with pytest.raises(ValueError, match="input_ids"):
        render_highlight_html(12, events, result, SpikeContext(ctx.loss_fn, ctx.token_mask))
    with pytest.raises(ValueError, match="window=-1"):
        render_highlight_html(12, events, result, ctx, window=-1)


def png_size(path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and head[12:16] == b"IHDR"
    return struct.unpack(">II", head[16:24])


def expected_columns(window: int, culprits=(40, 520), T=600, max_tokens=128) -> int:
    """Independent count: windows around each culprit, halved until they fit, one gap column between."""
    while True:
        n = sum(min(T, p + window + 1) - max(0, p - window) for p in culprits)  # windows do not overlap here
        if n <= max_tokens:
            return n + len(culprits) - 1
        window //= 2


@pytest.mark.parametrize("window", [3, 60])
def test_heatmap_png_has_one_column_per_token_in_window(tmp_path, window):
    import matplotlib.image

    events, result, ctx = make_case()
    out = render_layer_heatmap(result, 1, tmp_path / "h" / "map.png", ctx=ctx, window=window)
    n_cols = expected_columns(window)
    assert n_cols == (15 if window == 3 else 123)  # 7+gap+7; 60 -> 30 after one halving: 61+gap+61
    assert png_size(out) == heatmap_mod.heatmap_size_px(n_cols, len(LAYERS))
    pixels = matplotlib.image.imread(out)  # decodes: a valid PNG
    assert pixels.shape[:2] == heatmap_mod.heatmap_size_px(n_cols, len(LAYERS))[::-1]
    assert pixels[..., :3].std() > 0.05  # a picture, not a blank canvas


def test_heatmap_columns_are_the_context_windows_with_gaps():
    cols = heatmap_mod.heatmap_columns([40, 520], 600, 3)
    assert cols == list(range(37, 44)) + [None] + list(range(517, 524))
    assert heatmap_mod.heatmap_columns([2, 5], 8, 2) == list(range(0, 8))  # overlapping windows merge


def test_heatmap_size_grows_with_tokens_and_layers():
    w1, h1 = heatmap_mod.heatmap_size_px(100, 4)
    w2, h2 = heatmap_mod.heatmap_size_px(200, 8)
    assert w2 == 2 * w1 and h2 > h1


def test_heatmap_without_matplotlib_warns_and_skips(tmp_path, monkeypatch):
    import gradloc_track._optional as optional

    def missing(module, extra):  # fault injection: the extra is not installed
        raise ImportError(f"{module!r} is not installed; pip install 'gradloc-track[{extra}]'")

    monkeypatch.setattr(optional, "require", missing)
    events, result, ctx = make_case(T=40, culprits=((0, 3),), pad_from=40)
    with pytest.warns(UserWarning, match=r"gradloc-track\[plots\]"):
        assert render_layer_heatmap(result, 0, tmp_path / "x.png") is None
    assert not (tmp_path / "x.png").exists()


def test_a_window_ending_in_padding_runs_to_the_end_of_the_padding():
    events, result, ctx = make_case(culprits=((1, 555),), pad_from=560)
    page = render_highlight_html(12, events, result, ctx, window=10)
    shown = visible_text_div(page, 1)
    assert [int(t) for t in re.findall(r'title="position (\d+) \|', shown)] == list(range(545, 560))
    assert "positions 560-599: 40 x token id 0" in shown
    assert re.findall(r"\u2026 (\d+) tokens \u2026", shown) == ["545"]  # only the leading gap
    assert "positions 545\u2013599 of 600" in page


def test_heatmap_cuts_long_token_labels_so_the_layout_fits(tmp_path):
    class Tok:
        def decode(self, ids):
            return "<img src=x onerror=alert(1)>" * 3 if ids[0] == 999 else chr(ids[0])

    events, result, ctx = make_case()
    ctx.input_ids[1, 520] = 999
    ctx.tokenizer = Tok()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. matplotlib's "Tight layout not applied"
        out = render_layer_heatmap(result, 1, tmp_path / "m.png", ctx=ctx, window=4)
    assert png_size(out) == heatmap_mod.heatmap_size_px(9 + 1 + 9, len(LAYERS))
    assert heatmap_mod._label("<img src=x onerror=alert(1)>") == "<img\u2423src=\u2026"


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
