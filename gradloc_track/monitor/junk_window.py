"""The text of the run the junk signal would fire on, for ``spikes.text_check`` (issue 37).

Read only when the junk rule would fire (the detector asks): the rows whose largest run is above the margin,
largest first (at most ``MAX_ROWS``), each row's largest run read from the spike context's ids, decoded with
its tokenizer (or as bytes for a byte-level model) and encoded again (``text_check.read_window``). The first
run that is not plainly clean text is the one the detector judges; when every one is, the largest (a clean
name list in one row does not hide a junk sample in another). A few small host reads, on that step only. Under
torch.distributed the run lies in one rank's batch while every rank must decide alike: no text, the
signal stands.
"""
from __future__ import annotations

from typing import Any

import torch

from ..norms import is_distributed
from ..spikes.junk import JunkSpan, junk_parts, rows_above
from ..spikes.text_check import WindowText, clean_text, read_window
from .responder import resolve

MAX_ROWS = 8  # rows whose runs are read before the largest clean one is taken as the step's


def window_text(junk: Any, ctx: Any, terms: int, group: Any = None,
                margin: float | None = None) -> WindowText | None:
    """The text of the junk run the detector judges (module doc) among ``junk`` (a ``JunkSpan`` or one per
    micro-batch) in ``ctx`` (a ``SpikeContext`` or a callable building it); None when unknown. ``margin``:
    the rule's (``spikes.junk_margin``); None: the largest run alone."""
    if ctx is None or is_distributed(group):
        return None
    parts = junk_parts(junk)
    # the run is known only from JunkSpans that say where it is (a user may pass bare (span, mean) pairs)
    if not parts or any(not isinstance(p, JunkSpan) or p.where is None for p in parts):
        return None
    ctx = resolve(ctx)
    ids = getattr(ctx, "input_ids", None)
    if ids is None:
        return None
    if not isinstance(ids, torch.Tensor):
        if len(ids) != len(parts):
            return None  # the micro-batches do not pair with the junk statistics
    elif len(parts) != 1:
        return None
    tok = getattr(ctx, "tokenizer", None)
    first = None
    for k, row, start in _runs(parts, margin):
        rows = ids if isinstance(ids, torch.Tensor) else ids[k]
        text = read_window(rows[row].tolist(), start, start + terms, tok)
        if text is None or clean_text(text) is None:
            return text  # unknown (the signal stands), or not plainly clean: the run to judge
        first = first or text
    return first


def _runs(parts: list, margin: float | None) -> list[tuple[int, int, int]]:
    """(micro-batch, row, first position) of each row's largest run above ``margin``, largest first, at most
    ``MAX_ROWS``; the largest run alone when ``margin`` is None or the windows are not known. Host reads."""
    top = int(torch.stack([p.span.detach().float().cpu() for p in parts]).argmax())
    largest = [(top, *(int(v) for v in parts[top].where.tolist()))]
    if margin is None or any(p.windows is None for p in parts):
        return largest
    found = [(value, k, row, at) for k, part in enumerate(parts) for row, value, at in rows_above(part.windows, margin)]
    found.sort(key=lambda f: -f[0])
    return [(k, row, at) for _, k, row, at in found[:MAX_ROWS]] or largest
