"""Highlighted text: every token coloured by its gradient contribution, culprits outlined.

One section per sample that holds a culprit, across the step's micro-batches, named by
micro-batch and sample (and document): culprit tokens are outlined in red; a culprit span or
sample (a cause no few tokens carry) is outlined as a whole, in blue, with its share; a
micro-batch that carries the spike while nothing finer does gets a line of its own. The
localizer's notes (a step it could not replay exactly, the per-sample shares when nothing stood
out) are shown under the header.

A pure function returning one self-contained HTML document (inline CSS, no script, no external
URL; a Content-Security-Policy meta tag forbids both anyway). All token text is escaped, and
whitespace, control and format characters (including bidi overrides) are shown visibly, so what
a person reads is what the model was trained on.
"""
from __future__ import annotations

import html
import math
from dataclasses import dataclass
from typing import Any, Sequence

from ..localizer.culprit_view import CulpritView
from ..localizer.result import Culprit, CulpritToken, LocateResult
from ..spikes.event import SpikeEvent, lead_event
from ..text import MAX_TOKEN_CHARS, decode_token, token_html  # noqa: F401 - MAX_TOKEN_CHARS: read by tests
from ..units import micro_batch_label
from .table import format_top_layers

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:16px;color:#1d1d1f;background:#fff}
h1{font-size:18px;margin:0 0 6px} h2{font-size:15px;margin:18px 0 6px}
.meta{font-size:13px;color:#444} .meta b{color:#000}
.text{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:14px;line-height:1.9;
 white-space:pre-wrap;word-break:break-all;border:1px solid #ddd;border-radius:6px;padding:10px}
.t{border-radius:3px;padding:1px 0}
.c{border:2px solid #d00000;margin:0 1px;padding:0 1px;font-weight:bold;box-decoration-break:clone;
 -webkit-box-decoration-break:clone}
.u{outline:2px dashed #0050d0;outline-offset:2px;border-radius:3px}
.unit{color:#0050d0;font-weight:bold} .note{color:#7a4a00}
.cut{color:#a40;font-style:italic;font-weight:normal}
.ws{color:#999} .pad{color:#aaa;font-style:italic} .gap{color:#777;background:#eee;border-radius:3px;padding:0 4px}
.legend{display:flex;align-items:center;gap:6px;font-size:12px;margin:8px 0}
.ramp{display:inline-block;width:180px;height:12px;border:1px solid #ccc;
 background:linear-gradient(90deg,rgba(255,80,0,0.0),rgba(255,80,0,1.0))}
table{border-collapse:collapse;font-size:13px;margin-top:8px} td,th{border:1px solid #ccc;padding:3px 6px}
details{margin-top:8px} summary{cursor:pointer;color:#0645ad}
"""
CSP = "default-src 'none'; style-src 'unsafe-inline'"
PAD_RUN = 4  # this many identical no-loss tokens in a row (padding) collapse into one marker
# bounds on one event's page (B=32, T=2048 with 10k-character tokens made 8-11 MiB before)
MAX_SAMPLES = 8  # samples shown, those with the largest culprit first; the rest are counted
FULL_TEXT_SAMPLES = 2  # samples whose whole text sits in a collapsed block
FULL_TEXT_TOKENS = 2048  # ...up to this many tokens each


def _exact(c: Any) -> float | None:
    """A culprit token's exact gradient norm (its own probe, every layer), when it has a usable one."""
    v = getattr(c, "grad_norm", None)
    return float(v) if v is not None and math.isfinite(v) and v > 0 else None


def _score(ghost: float, c: Any) -> float:
    """A position's colour score: a culprit token's exact gradient norm, else its ghost norm. The ghost norm leaves
    the embeddings out, and two culprits were drawn in the opposite order of their exact shares (held-out tester,
    stop 64: token 1, share 0.66, drawn lighter than token 0, share 0.34)."""
    exact = _exact(c) if c is not None else None
    return ghost if exact is None else exact


def _alpha(v: float, lo: float, hi: float) -> float:
    """Log-scaled colour intensity in [0, 1] between the batch's smallest and largest score."""
    if v <= 0 or not math.isfinite(v):
        return 0.0
    if hi <= lo:
        return 1.0
    return max(0.0, min(1.0, (math.log(v) - lo) / (hi - lo)))


def context_windows(positions: Sequence[int], length: int, window: int) -> list[tuple[int, int]]:
    """Merged half-open ranges ``[p - window, p + window + 1)`` around each position, clipped."""
    spans: list[list[int]] = []
    for p in sorted(set(positions)):
        lo, hi = max(0, p - window), min(length, p + window + 1)
        if spans and lo <= spans[-1][1]:
            spans[-1][1] = max(spans[-1][1], hi)
        else:
            spans.append([lo, hi])
    return [(lo, hi) for lo, hi in spans]


class _Sample:
    """One sample's rows as python lists (the ``CulpritView``'s: read once per spike, not per token)."""

    def __init__(self, view: CulpritView, mb: int | None, sample: int, ghost_map: Any,
                 culprits: dict[int, CulpritToken], look: "_Look") -> None:
        self.ids = view.row("input_ids", mb, sample)
        mask = view.row("token_mask", mb, sample)
        self.in_loss = [v != 0 for v in mask] if mask is not None else [True] * len(self.ids)
        self.ghost = ghost_map[sample].tolist() if ghost_map is not None else [0.0] * len(self.ids)  # host sync
        self.tok = view.tokenizer
        self.culprits, self.lo, self.hi = culprits, look.lo, look.hi

    def token(self, p: int) -> str:
        tid, score, c = self.ids[p], self.ghost[p], self.culprits.get(p)
        title = f"position {p} | token id {tid} | ghost norm {score:.3e}"
        cls = "t"
        if not self.in_loss[p]:
            title += " | no loss term"
            cls += " ws"
        if c is not None:
            cls += " c"
            share = f"{c.share:.3f}" if c.share is not None else "n/a"
            title += (f" | CULPRIT grad norm {c.grad_norm:.3e} | share {share}"
                      f" | top layers {format_top_layers(c.layer_norms)}")
        a = _alpha(_score(score, c), self.lo, self.hi) if self.in_loss[p] else 0.0
        return (f'<span class="{cls}" style="background:rgba(255,80,0,{a:.2f})" '
                f'title="{html.escape(title, quote=True)}">{token_html(decode_token(self.tok, tid))}</span>')

    def _is_pad(self, p: int, q: int) -> bool:
        """Positions p and q hold the same token, neither a loss term nor a culprit (padding)."""
        return (self.ids[p] == self.ids[q] and not self.in_loss[p] and not self.in_loss[q]
                and p not in self.culprits and q not in self.culprits)

    def extend_over_padding(self, ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """Grow windows that end (or start) inside a padding run to the run's end: it costs one marker."""
        T, grown = len(self.ids), []
        for a, b in ranges:
            while b < T and self._is_pad(b - 1, b):
                b += 1
            while a > 0 and self._is_pad(a, a - 1):
                a -= 1
            grown.append((a, b))
        return _merge(grown)

    def spans(self, lo: int, hi: int) -> str:
        """Tokens ``lo..hi-1``; runs of identical no-loss tokens (padding) become one marker."""
        parts, p = [], lo
        while p < hi:
            q = p
            while q + 1 < hi and self._is_pad(p, q + 1):
                q += 1
            run = q - p + 1
            if run >= PAD_RUN and not self.in_loss[p] and p not in self.culprits:
                text = token_html(decode_token(self.tok, self.ids[p]))
                title = f"positions {p}-{q}: {run} x token id {self.ids[p]}, no loss term"
                parts.append(f'<span class="t ws pad" title="{html.escape(title, quote=True)}">{text}'
                             f' \u00d7{run}</span>')
                p = q + 1
            else:
                parts.append(self.token(p))
                p += 1
        return "".join(parts)


def _gap(n: int) -> str:
    return f'<span class="gap" title="{n} tokens not shown">\u2026 {n} tokens \u2026</span>'


def _sample_meta(view: CulpritView, mb: int | None, sample: int) -> str:
    """The sample's own numeric columns (an RL completion's reward, group, index), one line; '' without any."""
    cells = []
    for name in view.columns("sample_columns"):
        try:
            v = view.sample_cell(name, mb, sample)
        except (IndexError, TypeError, KeyError):  # a column of another shape: not shown
            continue
        if isinstance(v, (bool, int, float)):
            cells.append(f"{html.escape(str(name))} <b>{v:.4g}</b>" if isinstance(v, float) else
                         f"{html.escape(str(name))} <b>{v}</b>")
    return f"<div class='meta'>{' · '.join(cells)}</div>" if cells else ""


def segment_runs(seg: Sequence[int]) -> list[tuple[int, int, int]]:
    """(segment id, start, end) of each contiguous run of one id; -1 (not shown) is skipped."""
    runs: list[list[int]] = []
    for p, v in enumerate(seg):
        if v < 0:
            continue
        if runs and runs[-1][0] == v and runs[-1][2] == p:
            runs[-1][2] = p + 1
        else:
            runs.append([v, p, p + 1])
    return [(v, a, b) for v, a, b in runs]


def _windowed(s: "_Sample", a: int, b: int, marks: list[int], window: int) -> str:
    """Positions ``a..b-1``: windows around ``marks`` (all of it up to ``FULL_TEXT_TOKENS`` without marks)."""
    if not marks:
        n = min(b - a, FULL_TEXT_TOKENS)
        return s.spans(a, a + n) + (_gap(b - a - n) if n < b - a else "")
    out, prev = [], a
    for lo, hi in s.extend_over_padding([(max(a, x), min(b, y)) for x, y in context_windows(marks, b, window)]):
        lo, hi = max(a, lo), min(b, hi)
        if lo > prev:
            out.append(_gap(lo - prev))
        out.append(s.spans(lo, hi))
        prev = hi
    return "".join(out) + (_gap(b - prev) if prev < b else "")


def parts_html(s: "_Sample", seg: Sequence[int], names: Sequence[str] | None, window: int,
               units: Sequence[Any] = ()) -> str:
    """A sample shown part by part (``ctx.segment_ids``): an RL prompt and completion each in its
    own block; a packed row's documents, those without a culprit as one line each. A part a
    culprit unit (span, document, sample) covers is shown whole (up to ``FULL_TEXT_TOKENS``), outlined."""
    blocks = []
    for v, a, b in segment_runs(seg):
        name = names[v] if names is not None and 0 <= v < len(names) else f"document {v}"
        marks = [p for p in s.culprits if a <= p < b]
        inside = [u for u in units if u.start < b and u.end > a]
        head = f"<div class='meta'><b>{html.escape(name)}</b> · positions {a}\u2013{b - 1}" + \
            (f" · {len(marks)} culprit token(s)" if marks else "") + \
            "".join(f" · culprit {html.escape(u.level)}" for u in inside) + "</div>"
        if not marks and not inside and names is None:  # a document without culprits: named, not shown
            blocks.append(f"<div class='meta'>{html.escape(name)} · {b - a} tokens, no culprit</div>")
            continue
        if inside:
            end = min(b, a + FULL_TEXT_TOKENS)
            text = _outlined(s, a, end, list(inside)) + (_gap(b - end) if end < b else "")
        else:
            text = _windowed(s, a, b, marks, window)
        blocks.append(f"{head}<div class='text'>{text}</div>")
    return "".join(blocks)


def render_highlight_html(step: int, events: Sequence[SpikeEvent], result: LocateResult, ctx: Any,
                          window: int = 48) -> str:
    """One HTML page for a spike event: header, notes, legend, and each culprit sample's text.

    ``ctx``/``result`` may hold K micro-batches (sections then name the micro-batch). ``window``
    tokens either side of each culprit token are shown (a culprit span or sample in full, up to
    ``FULL_TEXT_TOKENS``); the rest of a sample is elided and its full text sits in a collapsed
    ``<details>`` block.
    """
    if ctx is None or getattr(ctx, "input_ids", None) is None:
        raise ValueError("render_highlight_html needs ctx.input_ids (the (B, T) token ids of the spiking "
                         "batch): pass them in the SpikeContext")
    if window < 0:
        raise ValueError(f"window={window} must be >= 0 (tokens shown either side of a culprit)")
    lo, hi = _colour_range(result)
    groups: dict[tuple, list] = {}
    for c in result.culprits:
        if c.batch is not None:
            groups.setdefault((c.micro_batch, c.batch), []).append(c)
    ranked = sorted(groups, key=lambda g: -max(c.grad_norm for c in groups[g]))
    shown = sorted(ranked[:MAX_SAMPLES], key=lambda g: (g[0] or 0, g[1]))
    culprit_view = CulpritView(result, ctx)  # names and rows as the table and the console read them
    body = []
    for key in shown:
        mb, sample = key
        ghost = (result.for_micro_batch(mb) if culprit_view.per_mb and mb is not None else result).ghost_map
        full = key in ranked[:FULL_TEXT_SAMPLES]
        body.append(_section(culprit_view, mb, sample, groups[key], ghost, _Look(lo, hi, window), full))
    if len(ranked) > MAX_SAMPLES:
        body.append(f"<p class='meta'>{len(ranked) - MAX_SAMPLES} more sample(s) with culprits are not shown here: "
                    "every culprit is listed in the spikes/tokens table</p>")
    body += [_micro_batch_line(c) for c in result.culprits if c.level == "micro_batch"]
    if not body:
        body.append("<p>No sample, span or loss term stood out: the spike is spread over the batch.</p>")
    return ("<!DOCTYPE html><html><head><meta charset='utf-8'>"
            f"<meta http-equiv='Content-Security-Policy' content=\"{CSP}\">"
            f"<title>spike at step {int(step)}</title><style>{CSS}</style></head><body>{_header(step, events, result)}"
            + LEGEND + "".join(body) + "</body></html>")


LEGEND = ("<div class='legend'>low <span class='ramp'></span> high gradient contribution (log scale: a culprit"
          " token's exact gradient norm, elsewhere the position's ghost norm, which leaves the embeddings out);"
          " <span class='t c'>outlined</span> = culprit token confirmed by an exact probe;"
          " <span class='u'>dashed</span> = culprit span or sample (no few tokens carry it);"
          " grey = no loss term; hover a token for its numbers</div>")


def _colour_range(result: LocateResult) -> tuple[float, float]:
    """Log of the smallest and largest positive score shown (``_score``) over every micro-batch: each map's ghost
    scores, a culprit token's exact norm in place of its own."""
    per_mb = bool(result.micro_batch_norms)
    maps = list(enumerate(result.ghost_maps)) if per_mb else [(None, result.ghost_map)]
    ends = []
    for k, m in maps:
        if m is None:
            continue
        m = m.detach().float().cpu().clone()
        exact = [(t, x) for t in result.tokens if (x := _exact(t)) is not None and (not per_mb or t.micro_batch == k)]
        for t, x in exact:
            if t.batch < m.shape[0] and t.position < m.shape[-1]:
                m[t.batch, t.position] = x
        v = m[(m > 0) & m.isfinite()]
        if v.numel():
            ends.append((float(v.min()), float(v.max())))
    ends += [(x, x) for x in (_exact(t) for t in result.tokens) if x is not None]  # (also where no map was made)
    if not ends:
        return 0.0, 0.0
    return math.log(min(a for a, _ in ends)), math.log(max(b for _, b in ends))


def _header(step: int, events: Sequence[SpikeEvent], result: LocateResult) -> str:
    esc = html.escape
    ev = lead_event(events)
    levels = {}
    for c in result.culprits:
        levels[c.level] = levels.get(c.level, 0) + 1
    found = ", ".join(f"{n} {lvl.replace('_', '-')}{'s' if n > 1 else ''}" for lvl, n in levels.items()) or "none"
    return (f"<h1>Gradient spike at step {int(step)}</h1><div class='meta'>"
            + (f"signal <b>{esc(str(ev.signal))}</b> · value <b>{ev.value:.4g}</b> · baseline <b>{ev.baseline:.4g}</b>"
               f" · z <b>{ev.z:.2f}</b> · ratio <b>{ev.ratio:.2f}</b><br>" if ev else "")
            + f"localizer <b>{esc(str(result.method))}</b> · {result.probes} probes · threshold {result.threshold:.3e}"
            + f" · batch gradient norm {result.total_norm:.4g} · {len(result.tokens)} culprit token(s)"
            + f" · culprits: {esc(found)}"
            + (" · probe budget exhausted" if result.budget_exhausted else "") + "</div>"
            + ("<div class='meta'>other signals: " + esc(", ".join(f"{e.signal} (z {e.z:.1f})" for e in events[1:]))
               + "</div>" if len(events) > 1 else "")
            + _cause_line(ev)
            + "".join(f"<div class='meta note'>{esc(n)}</div>" for n in result.notes))


def _cause_line(ev: SpikeEvent | None) -> str:
    """Why the step fired (``SpikeEvent.cause``), in words; empty when no cause was named."""
    if ev is None or not ev.cause:
        return ""
    return (f"<div class='meta'>cause <b>{html.escape(ev.cause)}</b>: "
            f"{html.escape(ev.cause_detail or '')}</div>")


def _unit_text(u: Culprit, T: int) -> str:
    share = "n/a" if u.share is None else f"{u.share:.3f}"
    what = "whole sample" if u.level == "sample" and u.document is None else \
        ("document" if u.level == "sample" else u.level)
    return (f"culprit {what}: {u.n_terms} loss terms at positions {u.start}\u2013{u.end - 1} of {T}"
            f" · share {share} · grad norm {u.grad_norm:.3e} · top layers {format_top_layers(u.layer_norms)}")


def _micro_batch_line(c: Culprit) -> str:
    share = "n/a" if c.share is None else f"{c.share:.3f}"
    return (f"<h2>{micro_batch_label(c.micro_batch)}</h2><div class='meta unit'>culprit micro-batch: no sample, "
            f"span or token in it stands out · {c.n_terms} loss terms · share {share} · grad norm "
            f"{c.grad_norm:.3e}</div>")


@dataclass(frozen=True)
class _Look:
    """How every section of a page is drawn: the colour scale's range and the context window."""

    lo: float
    hi: float
    window: int


def _section(view: CulpritView, mb: int | None, sample: int, culprits: list, ghost_map: Any, look: _Look,
             full_text: bool) -> str:
    """One sample: its name, the culprit units' lines, the text around the culprits, the token table."""
    window = look.window
    esc = html.escape
    tokens = {c.position: c for c in culprits if c.level == "token"}
    units = [c for c in culprits if c.level != "token"]
    s = _Sample(view, mb, sample, ghost_map, tokens, look)
    T = len(s.ids)
    ranges = context_windows(list(tokens), T, window)
    for u in units:  # a unit is shown whole (up to FULL_TEXT_TOKENS), with a little context; a whole sample with
        before = window if u.level == "sample" and u.document is None else min(window, 8)  # its prompt's tail
        ranges = _merge(ranges + [(max(0, u.start - before), min(T, u.start + FULL_TEXT_TOKENS, u.end + 8))])
    ranges = s.extend_over_padding(ranges)
    rows = "".join(
        f"<tr><td>{p}</td><td>{s.ids[p]}</td><td>{token_html(decode_token(s.tok, s.ids[p]))}</td>"
        f"<td>{c.grad_norm:.3e}</td><td>{'n/a' if c.share is None else f'{c.share:.3f}'}</td>"
        f"<td>{esc(format_top_layers(c.layer_norms))}</td></tr>"
        for p, c in sorted(tokens.items()))
    where = ", ".join(f"{a}\u2013{b - 1}" for a, b in ranges)
    shown_whole = [(u.start, u.end) for u in units] == ranges  # the unit's line already says the positions
    meta = " · ".join([_unit_text(u, T) for u in units] + ([] if shown_whole else [f"positions {where} of {T}"]))
    docs = {view.document(c) for c in culprits}
    doc = units[0].document if units else (docs.pop() if len(docs) == 1 else None)  # one document: named
    seg = view.row("segment_ids", mb, sample)
    if seg is not None:  # the sample's parts (prompt / completion, documents), each its block
        text = parts_html(s, seg, getattr(view.context, "segment_names", None), window, units)
    else:
        text = f"<div class='text'>{_shown(s, ranges, units)}</div>"
    section = [f"<h2>{esc(view.who(mb, sample, doc)[0])}</h2>", _sample_meta(view, mb, sample),
               f"<div class='meta'>{esc(meta)}</div>",
               text]
    if rows:  # culprit tokens: one row each (a span or whole-sample culprit has none: no empty table)
        section.append("<table><tr><th>position</th><th>token id</th><th>token</th><th>grad norm</th><th>share</th>"
                       f"<th>top layers</th></tr>{rows}</table>")
    if ranges != [(0, T)] and full_text:
        n = min(T, FULL_TEXT_TOKENS)
        more = f", first {n} shown" if n < T else ""
        section.append(f"<details><summary>full text ({T} tokens{more})</summary><div class='text'>"
                       f"{s.spans(0, n)}{_gap(T - n) if n < T else ''}</div></details>")
    return "".join(section)


def _shown(s: "_Sample", ranges: list[tuple[int, int]], units: list) -> str:
    """The sample's text over ``ranges`` (units outlined), a gap marker for each stretch left out."""
    shown, prev, T = [], 0, len(s.ids)
    for a, b in ranges:
        if a > prev:
            shown.append(_gap(a - prev))
        shown.append(_outlined(s, a, b, units))
        prev = b
    if prev < T:
        shown.append(_gap(T - prev))
    return "".join(shown)


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in sorted(ranges):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(b, out[-1][1]))
        else:
            out.append((a, b))
    return out


def _outlined(s: "_Sample", a: int, b: int, units: list) -> str:
    """Tokens ``a..b-1``, each culprit unit's part wrapped in one dashed outline."""
    parts, p = [], a
    for u in sorted(units, key=lambda u: u.start):
        lo, hi = max(p, u.start), min(b, u.end)
        if lo >= hi:
            continue
        if lo > p:
            parts.append(s.spans(p, lo))
        title = html.escape(f"CULPRIT {u.level}: loss terms at positions {u.start}-{u.end - 1}, share "
                            f"{'n/a' if u.share is None else f'{u.share:.3f}'}", quote=True)
        parts.append(f'<span class="u" title="{title}">{s.spans(lo, hi)}</span>')
        p = hi
    if p < b:
        parts.append(s.spans(p, b))
    return "".join(parts)
