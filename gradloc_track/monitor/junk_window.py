"""The text of the run the junk signal would fire on, for ``spikes.text_check`` (issue 37).

Read only when the junk rule would fire (the detector asks): the micro-batch whose run is the largest,
that run's row and first position (``JunkSpan.where``), and the spike context's ids there, decoded with its
tokenizer (or as bytes for a byte-level model). One small host read, on that step only. Under
torch.distributed the run lies in one rank's batch while every rank must decide alike: no text, the
signal stands.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..spikes.junk import JunkSpan, junk_parts
from ..spikes.text_check import decode_window
from .responder import resolve


def window_text(junk: Any, ctx: Any, terms: int, group: Any = None) -> str | None:
    """The decoded ``terms`` tokens of the largest junk run of ``junk`` (a ``JunkSpan`` or one per
    micro-batch) in ``ctx`` (a ``SpikeContext`` or a callable building it); None when unknown."""
    if ctx is None or (dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1):
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
    k = int(torch.stack([p.span.detach().float().cpu() for p in parts]).argmax())  # host read: a firing step
    row, start = (int(v) for v in parts[k].where.tolist())
    rows = ids if isinstance(ids, torch.Tensor) else ids[k]
    return decode_window(rows[row, start:start + terms].tolist(), getattr(ctx, "tokenizer", None))
