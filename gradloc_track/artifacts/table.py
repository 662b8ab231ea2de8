"""The token-attribution table: one row per culprit loss term of a spike event."""
from __future__ import annotations

from typing import Any, Sequence

from ..locate.result import LocateResult
from ..spikes.event import SpikeEvent

BASE_COLUMNS = ["step", "sample", "position", "token_id", "token", "grad_norm", "share", "top_layers",
                "signal", "z"]


def decode_token(tokenizer: Any, token_id: int | None) -> str:
    """One token's text; the id itself when there is no tokenizer."""
    if token_id is None:
        return ""
    if tokenizer is None:
        return f"<{token_id}>"
    try:
        return tokenizer.decode([int(token_id)])
    except Exception:
        return f"<{token_id}>"


def top_layers(layer_norms: dict[str, float], k: int = 3) -> str:
    best = sorted(layer_norms.items(), key=lambda kv: -kv[1])[:k]
    return ", ".join(f"{name}:{val:.2e}" for name, val in best)


def _value(t: Any, b: int, p: int | None = None) -> Any:
    v = t[b] if p is None else t[b, p]
    return float(v) if hasattr(v, "item") else v


def attribution_table(step: int, events: Sequence[SpikeEvent], result: LocateResult, ctx: Any,
                      top_k: int = 3, extra_columns: Sequence[str] | None = None,
                      sample_columns: Sequence[str] | None = None) -> tuple[list[str], list[list[Any]]]:
    """(columns, rows). ``extra_columns``/``sample_columns`` fix the column set across events."""
    extras = list(extra_columns if extra_columns is not None else getattr(ctx, "extra_columns", {}) or {})
    samples = list(sample_columns if sample_columns is not None else getattr(ctx, "sample_columns", {}) or {})
    columns = BASE_COLUMNS + extras + samples
    lead = events[0] if events else None
    ids = getattr(ctx, "input_ids", None)
    tok = getattr(ctx, "tokenizer", None)
    rows = []
    for c in result.tokens:
        token_id = int(ids[c.batch, c.position]) if ids is not None else None
        row = [step, c.batch, c.position, token_id, decode_token(tok, token_id), c.grad_norm, c.share,
               top_layers(c.layer_norms, top_k), lead.signal if lead else None, lead.z if lead else None]
        ec = getattr(ctx, "extra_columns", {}) or {}
        sc = getattr(ctx, "sample_columns", {}) or {}
        row += [_value(ec[n], c.batch, c.position) if n in ec else None for n in extras]
        row += [_value(sc[n], c.batch) if n in sc else None for n in samples]
        rows.append(row)
    return columns, rows
