"""Highlighted text: every token coloured by its gradient contribution, culprits outlined.

A pure function returning one self-contained HTML document (inline CSS, no script, no external
URL). All token text is escaped; whitespace and control characters are shown visibly.
"""
from __future__ import annotations

import html
import math
from typing import Any, Sequence

from ..locate.result import LocateResult
from ..spikes.event import SpikeEvent
from .table import decode_token, top_layers

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;margin:16px;color:#1d1d1f;background:#fff}
h1{font-size:18px;margin:0 0 6px} h2{font-size:15px;margin:18px 0 6px}
.meta{font-size:13px;color:#444} .meta b{color:#000}
.text{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:14px;line-height:1.9;
 white-space:pre-wrap;word-break:break-all;border:1px solid #ddd;border-radius:6px;padding:10px}
.t{border-radius:3px;padding:1px 0} .c{outline:2px solid #d00000;outline-offset:1px;font-weight:bold}
.ws{color:#999} .legend{display:flex;align-items:center;gap:6px;font-size:12px;margin:8px 0}
.ramp{display:inline-block;width:180px;height:12px;border:1px solid #ccc;
 background:linear-gradient(90deg,rgba(255,80,0,0.0),rgba(255,80,0,1.0))}
table{border-collapse:collapse;font-size:13px;margin-top:8px} td,th{border:1px solid #ccc;padding:3px 6px}
details{margin-top:8px} summary{cursor:pointer;color:#0645ad}
"""

_VISIBLE = {"\n": "\u21b5\n", "\t": "\u2192", "\r": "\u240d", " ": " "}


def visible(text: str) -> str:
    """Escaped token text with newlines/tabs/control characters made visible."""
    out = []
    for ch in text:
        if ch in _VISIBLE:
            out.append(_VISIBLE[ch])
        elif ord(ch) < 32 or ord(ch) == 127:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return html.escape("".join(out), quote=True)


def _alpha(v: float, lo: float, hi: float) -> float:
    """Log-scaled colour intensity in [0, 1]."""
    if v <= 0 or hi <= lo:
        return 0.0
    return max(0.0, min(1.0, (math.log(v) - lo) / (hi - lo)))


def _spans(sample: int, positions: Sequence[int], result: LocateResult, ctx: Any, culprits: dict, lo: float,
           hi: float) -> str:
    ids = ctx.input_ids
    tok = getattr(ctx, "tokenizer", None)
    mask = ctx.token_mask
    ghost = result.ghost_map
    parts = []
    for p in positions:
        tid = int(ids[sample, p])
        text = decode_token(tok, tid)
        score = float(ghost[sample, p]) if ghost is not None else 0.0
        in_loss = float(mask[sample, p]) != 0
        c = culprits.get(p)
        title = f"position {p} | token id {tid} | ghost norm {score:.3e}"
        cls = "t"
        if not in_loss:
            title += " | no loss term"
            cls += " ws"
        if c is not None:
            cls += " c"
            title += f" | CULPRIT grad norm {c.grad_norm:.3e} | share {c.share if c.share is not None else float('nan'):.3f}" \
                     f" | top layers {top_layers(c.layer_norms)}"
        a = _alpha(score, lo, hi) if in_loss else 0.0
        parts.append(f'<span class="{cls}" style="background:rgba(255,80,0,{a:.2f})" '
                     f'title="{html.escape(title, quote=True)}">{visible(text)}</span>')
    return "".join(parts)


def render_highlight_html(step: int, events: Sequence[SpikeEvent], result: LocateResult, ctx: Any,
                          window: int = 48) -> str:
    """One HTML page for a spike event: header, legend, and each affected sample's text."""
    ev = events[0] if events else None
    ghost = result.ghost_map
    positive = ghost[ghost > 0] if ghost is not None else None
    if positive is not None and positive.numel():
        lo, hi = math.log(float(positive.min())), math.log(float(positive.max()))
    else:
        lo, hi = 0.0, 1.0
    by_sample: dict[int, dict[int, Any]] = {}
    for c in result.tokens:
        by_sample.setdefault(c.batch, {})[c.position] = c
    esc = html.escape
    head = (f"<h1>Gradient spike at step {step}</h1><div class='meta'>"
            + (f"signal <b>{esc(ev.signal)}</b> · value <b>{ev.value:.4g}</b> · baseline <b>{ev.baseline:.4g}</b>"
               f" · z <b>{ev.z:.2f}</b> · ratio <b>{ev.ratio:.2f}</b><br>" if ev else "")
            + f"localizer <b>{esc(result.method)}</b> · {result.probes} probes · threshold {result.threshold:.3e}"
            + f" · batch gradient norm {result.total_norm:.4g} · {len(result.tokens)} culprit token(s)</div>"
            + ("<div class='meta'>other signals: " + esc(", ".join(f"{e.signal} (z {e.z:.1f})" for e in events[1:]))
               + "</div>" if len(events) > 1 else ""))
    legend = ("<div class='legend'>low <span class='ramp'></span> high gradient contribution (log scale, ghost norm"
              " per position); <span class='t c'>outlined</span> = culprit confirmed by an exact probe;"
              " hover a token for its numbers</div>")
    body = []
    T = ctx.input_ids.shape[1]
    for sample in sorted(by_sample):
        culprits = by_sample[sample]
        lo_p, hi_p = max(0, min(culprits) - window), min(T, max(culprits) + window + 1)
        rows = "".join(
            f"<tr><td>{p}</td><td>{visible(decode_token(getattr(ctx, 'tokenizer', None), int(ctx.input_ids[sample, p])))}"
            f"</td><td>{c.grad_norm:.3e}</td><td>{(c.share or 0):.3f}</td><td>{esc(top_layers(c.layer_norms))}</td></tr>"
            for p, c in sorted(culprits.items()))
        section = [f"<h2>sample {sample}</h2>",
                   f"<div class='meta'>positions {lo_p}–{hi_p - 1} of {T}</div>",
                   f"<div class='text'>{'…' if lo_p > 0 else ''}"
                   f"{_spans(sample, range(lo_p, hi_p), result, ctx, culprits, lo, hi)}{'…' if hi_p < T else ''}</div>",
                   "<table><tr><th>position</th><th>token</th><th>grad norm</th><th>share</th><th>top layers</th></tr>"
                   f"{rows}</table>"]
        if lo_p > 0 or hi_p < T:
            section.append(f"<details><summary>full text ({T} tokens)</summary><div class='text'>"
                           f"{_spans(sample, range(T), result, ctx, culprits, lo, hi)}</div></details>")
        body.append("".join(section))
    if not body:
        body.append("<p>No single loss term was above the threshold: the spike is spread over many tokens.</p>")
    return ("<!DOCTYPE html><html><head><meta charset='utf-8'>"
            "<meta http-equiv='Content-Security-Policy' content=\"default-src 'none'; style-src 'unsafe-inline'\">"
            f"<title>spike at step {step}</title><style>{CSS}</style></head><body>{head}{legend}"
            + "".join(body) + "</body></html>")
