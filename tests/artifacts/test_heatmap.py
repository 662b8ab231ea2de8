"""The layer x token heatmap: one column per token in the culprits' windows, no padding, every table
layer, a bounded size; positions without a loss term marked as such, labels that say what is drawn."""
from __future__ import annotations

import struct
import warnings

import numpy as np
import pytest

from gradloc_track.artifacts import heatmap as heatmap_mod
from gradloc_track.artifacts.heatmap import heatmap_grid, render_layer_heatmap

from .cases import LAYERS, make_case


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


def test_tokens_the_font_cannot_draw_are_written_as_escapes_without_a_warning(tmp_path):
    """Hebrew and emoji are not in the tick labels' monospace font: they were drawn as empty boxes, with one
    'Glyph ... missing from font' warning each on the training's stderr (held-out tester round 8). Written
    as their escapes now; a character the font has stays itself."""
    from matplotlib.font_manager import FontProperties, findfont
    from matplotlib.ft2font import FT2Font

    drawn = FT2Font(findfont(FontProperties(family="monospace"))).get_charmap()  # independent of the helper
    texts = {40: "\u05e9\u05dc\u05d5\u05dd", 41: "\U0001f468\u200d\U0001f469", 42: "caf\u00e9"}

    class Tok:
        def decode(self, ids):
            return texts.get(ids[0], "a")

    events, result, ctx = make_case()
    for p in texts:
        ctx.input_ids[1, p] = p
    ctx.tokenizer = Tok()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        render_layer_heatmap(result, 1, tmp_path / "m.png", ctx=ctx, window=4)
    for text in texts.values():
        label = heatmap_mod._label(text)
        assert all(ord(ch) in drawn for ch in label), (text, label)
    assert heatmap_mod._label("\u05e9") == "\\u05e9" and heatmap_mod._label("\U0001f468") == "\\U0001f468"
    assert heatmap_mod._label("caf\u00e9") == "caf\u00e9"


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


def prompt_case(loss_free=range(36, 47)):
    """A sample whose positions 36-46 have no loss term (a prompt) that the per-position pass coloured."""
    events, result, ctx = make_case(T=80, culprits=((1, 60), (1, 48)), pad_from=76)
    ctx.token_mask[1, list(loss_free)] = 0.0
    result.layer_map[:, 1, list(loss_free)] = 50.0  # larger than any culprit: must neither show nor set the scale
    return result, ctx


def drawn_figure(monkeypatch, result, ctx, path):
    """Render, keeping the figure it saves (to read what its labels say)."""
    from matplotlib.figure import Figure

    kept, save = [], Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: (kept.append(fig), save(fig, *a, **k))[1])
    render_layer_heatmap(result, 1, path, ctx=ctx)
    (fig,) = kept
    return fig


def test_a_heatmap_leaves_the_users_pyplot_alone(tmp_path):
    """Drawn in the user's process (a finishing run's hurried render), the heatmap switches no backend and
    leaves no figure open in pyplot."""
    import matplotlib
    import matplotlib.pyplot as plt

    before = matplotlib.get_backend()
    plt.switch_backend("svg")
    try:
        result, ctx = prompt_case()
        assert render_layer_heatmap(result, 1, tmp_path / "u.png", ctx=ctx) is not None
        assert matplotlib.get_backend() == "svg" and plt.get_fignums() == []
    finally:
        plt.switch_backend(before)


def test_positions_without_a_loss_term_are_left_out_of_the_colours_and_the_scale():
    result, ctx = prompt_case()
    cols, names, data, _ = heatmap_grid(result, 1, ctx, window=24)
    free = [i for i, p in enumerate(cols) if p is not None and 36 <= p <= 46]
    assert len(free) == 11  # the prompt is shown (context for a reader), as no value
    assert all(v != v for v in data[:, free].ravel())  # NaN: not a colour-scale value
    assert float(np.nanmax(data)) == pytest.approx(3.0)  # the culprit's largest layer norm sets the scale, not 50


def test_the_picture_marks_loss_free_positions_and_says_what_is_drawn(tmp_path, monkeypatch):
    import matplotlib.image

    result, ctx = prompt_case()
    fig = drawn_figure(monkeypatch, result, ctx, tmp_path / "p.png")
    ax, bar = fig.axes
    assert "loss term" in ax.get_title() and "loss term" in bar.get_ylabel()  # not "this token's loss"
    assert "no loss term" in ax.get_xlabel()
    grey = (np.abs(matplotlib.image.imread(tmp_path / "p.png")[..., :3] - 0xD9 / 255) < 2 / 255).all(-1)
    assert grey.sum(0).max() > 150  # a pixel column of the hatched grey band (not anti-aliased text)
    result, ctx = prompt_case(loss_free=[])
    fig = drawn_figure(monkeypatch, result, ctx, tmp_path / "q.png")
    assert "no loss term" not in fig.axes[0].get_xlabel()
    grey = (np.abs(matplotlib.image.imread(tmp_path / "q.png")[..., :3] - 0xD9 / 255) < 2 / 255).all(-1)
    assert grey.sum(0).max() < 50  # every position has a loss term: no band
