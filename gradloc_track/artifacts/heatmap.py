"""Per-layer picture of a spike: loss positions (around the culprits) x layers, log colour scale.

Shows the "layerwise heterogeneity" GradLoc reports: a culprit token can hit a few layers hard
while others stay calm. A cell is the gradient norm, in that layer, of the loss term at that
position. Positions without a loss term (an SFT prompt, masked tokens) have no such gradient:
they are drawn hatched grey, never in the colour scale, and do not set it; padding is left out.
Rendered on a ``Figure`` of its own (Agg, no display needed), never through pyplot: the user's backend
and open figures stay as they are when a heatmap is drawn in their process. One at a time in a process
(``_DRAWING``): matplotlib's text layout is not thread-safe (a tracker's thread and a finishing run's
late thread can both draw).
"""
from __future__ import annotations

import functools

import io
import os
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Any

import torch

from ..localizer.result import LocateResult
from .highlight import context_windows
from ..text import decode_token, escape_char

DPI = 100
_DRAWING = threading.Lock()  # one heatmap drawn at a time in this process (module doc)
CELL_W_IN = 0.28  # inches per token column
ROW_H_IN = 0.45  # inches per layer row
MIN_W_IN = 6.0  # narrow windows still leave room for the title and colour bar
MARGIN_H_IN = 1.8  # title + token labels + the axis label
NO_LOSS_COLOUR = "#d9d9d9"  # hatched grey: no loss term at the position (not a colour-scale value)
COLOURBAR_LABEL = "gradient norm of the position's loss term (log)"


def heatmap_columns(positions: list[int], length: int, window: int, max_tokens: int = 128) -> list[int | None]:
    """Token positions drawn as columns, ``None`` = a gap between two context windows.

    ``window`` tokens either side of each culprit (windows merged), narrowed until at most
    ``max_tokens`` tokens remain, so far-apart culprits in a long sequence stay readable.
    """
    w = window
    while True:
        ranges = context_windows(positions, length, w)
        if sum(b - a for a, b in ranges) <= max_tokens or w == 0:
            break
        w //= 2
    cols: list[int | None] = []
    for a, b in ranges:
        if cols:
            cols.append(None)
        cols.extend(range(a, b))
    return cols[: max_tokens + len(ranges) - 1]


def padding_positions(ctx: Any, sample: int) -> set[int]:
    """Positions of ``sample`` that are padding: no loss term AND the pad token.

    The pad token is ``ctx.tokenizer.pad_id`` when the tokenizer has one, else the token that
    fills a run of at least 4 loss-free positions at the end of the sample (right padding).
    Loss-free text (an SFT prompt) stays: it is the context a reader needs.
    """
    mask, ids_t = getattr(ctx, "token_mask", None), getattr(ctx, "input_ids", None)
    if mask is None or ids_t is None or isinstance(mask, (list, tuple)):
        return set()
    keep = mask[sample].tolist()  # host sync: once per heatmap
    ids = ids_t[sample].tolist()
    pad = getattr(getattr(ctx, "tokenizer", None), "pad_id", None)
    if pad is None and len(ids) >= 4 and not any(keep[-4:]) and len(set(ids[-4:])) == 1:
        pad = ids[-1]
    if pad is None:
        return set()
    return {p for p, (k, t) in enumerate(zip(keep, ids)) if not k and t == pad}


def loss_free_positions(ctx: Any, sample: int) -> set[int]:
    """Positions of ``sample`` without a loss term (``token_mask`` 0): nothing of theirs to draw."""
    mask = getattr(ctx, "token_mask", None)
    if mask is None or isinstance(mask, (list, tuple)):
        return set()
    return {p for p, k in enumerate(mask[sample].tolist()) if not k}  # host sync: once per heatmap


def heatmap_size_px(n_tokens: int, n_layers: int) -> tuple[int, int]:
    """(width, height) in pixels of the PNG for ``n_tokens`` columns and ``n_layers`` rows."""
    return round(max(MIN_W_IN, CELL_W_IN * n_tokens) * DPI), round((ROW_H_IN * n_layers + MARGIN_H_IN) * DPI)


LABEL_CHARS = 10  # longer token texts are cut: rotated labels must fit the bottom margin


def _label(text: str) -> str:
    """Tick label: non-printable characters as escapes (matplotlib would draw boxes or nothing)."""
    out = _printable(text)
    return out if len(out) <= LABEL_CHARS else out[: LABEL_CHARS - 1] + "\u2026"


def _printable(text: str) -> str:
    glyphs = _font_glyphs()
    return "".join(ch if ch.isprintable() and ch != " " and (glyphs is None or ord(ch) in glyphs) else
                   ("\u2423" if ch == " " else escape_char(ch)) for ch in text) or "\u2205"


@functools.lru_cache(maxsize=1)
def _font_glyphs() -> frozenset[int] | None:
    """The code points the tick labels' monospace font draws: any other (Hebrew, emoji in DejaVu Sans Mono) is
    written as its escape, not drawn as an empty box with a 'Glyph missing' warning on the training's stderr
    (held-out tester round 8). None: the font cannot be read (every printable character is drawn)."""
    try:
        from matplotlib.font_manager import FontProperties, findfont
        from matplotlib.ft2font import FT2Font

        return frozenset(FT2Font(findfont(FontProperties(family="monospace"))).get_charmap())
    except Exception:
        return None


def _runs(cols: list[int | None]) -> list[tuple[int, int]]:
    """Contiguous position ranges (half-open) of a column list with ``None`` gaps."""
    out: list[tuple[int, int]] = []
    for p in cols:
        if p is None:
            continue
        if out and out[-1][1] == p:
            out[-1] = (out[-1][0], p + 1)
        else:
            out.append((p, p + 1))
    return out


def heatmap_grid(result: LocateResult, sample: int, ctx: Any = None, window: int = 24,
                 max_tokens: int = 128) -> tuple[list[int | None], list[str], Any, list]:
    """(columns, row names, (rows, columns) float array, the sample's culprits) of the heatmap.

    Columns: positions around the culprits, padding dropped, ``None`` = a break. Rows: the
    per-position layers, then every other layer the table lists for the culprits (exact norms at
    the culprits' columns only, NaN elsewhere). Columns of positions without a loss term are NaN.
    """
    T = result.layer_map.shape[2]
    mine = [c for c in result.tokens if c.batch == sample]  # one micro-batch's result (for_micro_batch)
    units = [c for c in result.culprits if c.level != "token" and c.batch == sample and c.start is not None]
    culprit_pos = [c.position for c in mine] or [p for u in units for p in range(u.start, u.end)] or [0]
    pads = padding_positions(ctx, sample) - set(culprit_pos)
    cols = [p for p in heatmap_columns(culprit_pos, T, window, max_tokens) if p not in pads]
    while cols and cols[0] is None:
        cols.pop(0)
    while cols and cols[-1] is None:
        cols.pop()
    cols = [p for i, p in enumerate(cols) if p is not None or cols[i - 1] is not None]  # one gap marker per break
    idx = torch.tensor([p if p is not None else 0 for p in cols])
    data = result.layer_map[:, sample].index_select(1, idx).float().nan_to_num(0.0, 0.0, 0.0)  # (L, C)
    free = loss_free_positions(ctx, sample)
    data[:, [i for i, p in enumerate(cols) if p in free]] = float("nan")  # no loss term: no value, no scale
    # layers the table lists that the per-position pass does not cover (embeddings, norms): their
    # exact norms are known at the culprits only; other cells stay blank
    names = list(result.layer_names)
    extra = [n for c in mine for n in c.layer_norms if n not in names]
    extra = list(dict.fromkeys(extra))
    if extra:
        rows = torch.full((len(extra), len(cols)), float("nan"))
        for c in mine:
            for i, p in enumerate(cols):
                if p == c.position:
                    for r, n in enumerate(extra):
                        rows[r, i] = float(c.layer_norms.get(n, float("nan")))
        data = torch.cat([data, rows])
        names += [f"{n} (culprits only)" for n in extra]
    finite = data[torch.isfinite(data)]
    vmax = float(finite.max()) if finite.numel() and float(finite.max()) > 0 else 1.0
    data = data.clamp_min(vmax * 1e-6).numpy()  # log scale: zero contributions sit at the ramp's bottom (NaN stays)
    return cols, names, data, mine


def _mark_columns(ax: Any, cols: list[int | None], culprits: set[int], loss_free: set[int]) -> None:
    """Dashed lines at the culprits; hatched grey over positions without a loss term (and the axis says so)."""
    for i, p in enumerate(cols):
        if p in culprits:
            ax.axvline(i, color="cyan", lw=0.8, ls="--")
        elif p in loss_free:
            ax.axvspan(i - 0.5, i + 0.5, facecolor=NO_LOSS_COLOUR, edgecolor="#9a9a9a", hatch="///", lw=0)
    shown = "token at each position" + ("; hatched grey: no loss term there (prompt or masked), nothing to draw"
                                        if any(p in loss_free for p in cols) else "")
    ax.set_xlabel(shown, fontsize=8)


def render_layer_heatmap(result: LocateResult, sample: int, path: str | Path, ctx: Any = None,
                         window: int = 24, max_tokens: int = 128) -> Path | None:
    """Write a PNG of ``result.layer_map[:, sample]`` around the sample's culprits; the path (another one
    when ``path``'s disk is full: ``stage_png``).

    Token labels come from ``ctx.input_ids``/``ctx.tokenizer`` when given, else positions.
    ``None`` (with a warning) when matplotlib is missing or the result carries no layer map.
    """
    from .._optional import require

    try:
        require("matplotlib", "plots")
    except ImportError as exc:
        warnings.warn(f"gradloc-track: no heatmap image is written: {exc}")
        return None
    if result.layer_map is None or not result.layer_names:
        warnings.warn("gradloc-track: no heatmap image: the localization result has no layer_map")
        return None
    L, B, T = result.layer_map.shape  # (L, B, T)
    if not 0 <= sample < B:
        raise ValueError(f"sample={sample} is outside the batch of the layer map (B={B})")
    from matplotlib import colormaps
    from matplotlib.colors import LogNorm
    from matplotlib.figure import Figure

    import numpy as np

    cols, names, data, mine = heatmap_grid(result, sample, ctx, window, max_tokens)
    L = len(names)
    vmax = float(np.nanmax(data)) if np.isfinite(data).any() else 1.0
    gaps = [i for i, p in enumerate(cols) if p is None]
    data[:, gaps] = float("nan")  # drawn in the "bad" colour: a visible break between windows
    ids = ctx.input_ids[sample].tolist() if getattr(ctx, "input_ids", None) is not None else None  # host sync
    tok = getattr(ctx, "tokenizer", None)
    labels = ["\u2026" if p is None else (_label(decode_token(tok, ids[p])) if ids is not None else str(p))
              for p in cols]
    cmap = colormaps["magma"].with_extremes(bad="#ffffff")
    where = ", ".join(f"{a}-{b - 1}" for a, b in _runs(cols))
    # a Figure of its own, never pyplot: the user's backend and figures are left as they are
    with _DRAWING:
        fig = Figure(figsize=tuple(s / DPI for s in heatmap_size_px(len(cols), L)), dpi=DPI)
        ax = fig.subplots()
        im = ax.imshow(data, aspect="auto", cmap=cmap, norm=LogNorm(vmin=vmax * 1e-6, vmax=vmax),
                       interpolation="nearest")
        ax.set_yticks(range(L), names, fontsize=8)
        ax.set_xticks(range(len(cols)), labels, fontsize=7, rotation=90, family="monospace")
        _mark_columns(ax, cols, {c.position for c in mine}, loss_free_positions(ctx, sample))
        ax.set_title(f"per-layer gradient norm of each position's loss term, sample {sample} (positions {where})",
                     fontsize=9)
        fig.colorbar(im, ax=ax, fraction=0.025, label=COLOURBAR_LABEL)
        fig.tight_layout()
        png = io.BytesIO()
        fig.savefig(png, format="png", dpi=DPI)  # in memory: a full disk never leaves a 0-byte image
    return stage_png(Path(path), png.getvalue())


def stage_png(path: Path, data: bytes) -> Path:
    """``data`` at ``path`` (atomically: the whole image or none); where the run dir has no room (a full
    disk), a file of the system's temp dir instead, so the image still reaches the tracker."""
    from ..trackers.files import atomic_write_bytes

    try:
        atomic_write_bytes(path, data)
        return path
    except OSError as exc:
        fd, other = tempfile.mkstemp(prefix=f"gradloc-{path.stem}-", suffix=".png")
        os.close(fd)
        atomic_write_bytes(other, data)  # (an error here too: the job says the image could not be kept)
        warnings.warn(f"gradloc-track: no room for {path} ({exc.strerror or exc}); the heatmap is staged in "
                      f"{other} instead", RuntimeWarning)
        return Path(other)
