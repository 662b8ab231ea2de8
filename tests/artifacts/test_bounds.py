"""Artifacts a reader can use at any batch size: bounded pages, no padding in the heatmap, every table layer."""
from __future__ import annotations

import re

import torch

from gradloc_track.artifacts.heatmap import heatmap_grid, render_layer_heatmap
from gradloc_track.artifacts.highlight import CSS, MAX_SAMPLES, MAX_TOKEN_CHARS, render_highlight_html
from gradloc_track.localizer.result import CulpritToken, LocateResult
from gradloc_track.spikes.context import SpikeContext
from gradloc_track.spikes.event import SpikeEvent

from .test_render import LAYERS, make_case


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


def test_heatmap_drops_padding_and_adds_every_table_layer(tmp_path):
    events, result, ctx = make_case(T=80, culprits=((1, 60), (1, 61)), pad_from=66)
    for c in result.tokens:  # exact probes also see layers the per-position pass does not cover
        c.layer_norms["ln_f"] = 0.7
    cols, names, data, _ = heatmap_grid(result, 1, ctx, window=24)
    assert not [p for p in cols if p is not None and p >= 66], "padding columns are drawn"
    assert 60 in cols and 61 in cols and cols[0] == 36
    table_layers = {n for c in result.tokens for n in c.layer_norms}
    assert [n.split(" ")[0] for n in names] == LAYERS + ["ln_f"] and table_layers <= {n.split(" ")[0] for n in names}
    row = data[names.index("ln_f (culprits only)")]
    assert row[cols.index(60)] == row[cols.index(61)] == 0.7
    assert all(v != v for i, v in enumerate(row) if cols[i] not in (60, 61))  # NaN: not estimated
    assert render_layer_heatmap(result, 1, tmp_path / "h.png", ctx=ctx).stat().st_size > 1000
