"""The token-attribution table: one row per culprit loss term of a spike event.

Every row names its sample by ``sample_id``, the fingerprint of the sample's loss-bearing token
ids (``identity``: the same text gives the same id in any run; in a packed row with
``document_ids``, the culprit's document), next to the context's per-sample columns (dataset
index, source, ...).
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from ..localizer.result import LocateResult
from .identity import row_fingerprint
from ..spikes.event import SpikeEvent

# what a reader scans first: when, which text, how much of the spike it carries; then where
BASE_COLUMNS = ["step", "token", "share", "grad_norm", "sample", "position", "top_layers", "signal", "z",
                "token_id", "sample_id"]


def decode_token(tokenizer: Any, token_id: int | None) -> str:
    """One token's text; ``<id>`` when there is no tokenizer or it cannot decode the id."""
    if token_id is None:
        return ""
    if tokenizer is None:
        return f"<{token_id}>"
    try:
        return str(tokenizer.decode([int(token_id)]))
    except Exception:
        return f"<{token_id}>"


def format_top_layers(layer_norms: dict[str, float], k: int = 3) -> str:
    """``"h.3:1.2e-01, lm_head:4.0e-02"``: the ``k`` layers this token's gradient hits hardest."""
    best = sorted(layer_norms.items(), key=lambda kv: -kv[1])[:k]
    return ", ".join(f"{name}:{val:.2e}" for name, val in best)


def _cpu_lists(columns: dict[str, Any]) -> dict[str, list]:
    """Each column to nested python lists: one host sync per tensor instead of one per cell
    (a per-micro-batch sequence of tensors becomes a list of them)."""
    def conv(t):
        if hasattr(t, "tolist"):
            return t.tolist()
        return [conv(x) for x in t] if isinstance(t, (list, tuple)) else t

    return {n: conv(t) for n, t in columns.items()}  # host sync


def attribution_table(step: int, events: Sequence[SpikeEvent], result: LocateResult, ctx: Any,
                      top_layers: int = 3, extra_columns: Sequence[str] | None = None,
                      sample_columns: Sequence[str] | None = None) -> tuple[list[str], list[list[Any]]]:
    """(columns, rows), one row per culprit token.

    ``extra_columns``/``sample_columns`` name the context columns to emit (default: those in
    ``ctx``); the writer fixes them at the first event so a growing table keeps one column set.
    Names absent from ``ctx`` give ``None`` cells.
    """
    ec = getattr(ctx, "extra_columns", None) or {}
    sc = getattr(ctx, "sample_columns", None) or {}
    extras = list(extra_columns if extra_columns is not None else ec)
    samples = list(sample_columns if sample_columns is not None else sc)
    # micro_batch / rank columns only when the localization set them (a step of several
    # micro-batches, a distributed run); their values then index ctx's per-micro-batch sequences
    where = [name for name in ("micro_batch", "rank") if any(getattr(c, name, None) is not None for c in result.tokens)]
    columns = BASE_COLUMNS[:1] + where + BASE_COLUMNS[1:] + extras + samples
    if not result.tokens:
        return columns, []
    lead = events[0] if events else None
    ids_t = getattr(ctx, "input_ids", None)
    ids = _cpu_lists({"ids": ids_t})["ids"] if ids_t is not None else None  # host sync: once per spike event
    # the loss mask and packed-document map: the rows' sample ids (host sync: once per spike event)
    where_t = {"mask": getattr(ctx, "token_mask", None), "docs": getattr(ctx, "document_ids", None)}
    where_l = _cpu_lists({n: t for n, t in where_t.items() if t is not None})
    ev = _cpu_lists({n: ec[n] for n in extras if n in ec})
    sv = _cpu_lists({n: sc[n] for n in samples if n in sc})
    tok = getattr(ctx, "tokenizer", None)
    per_mb = not isinstance(getattr(ctx, "token_mask", None), torch.Tensor)  # ctx holds K micro-batches
    rows = []
    for c in result.tokens:
        mb = getattr(c, "micro_batch", None)

        def at(v):  # the micro-batch's entry of a per-micro-batch sequence
            return v[mb] if mb is not None and per_mb else v

        token_id = int(at(ids)[c.batch][c.position]) if ids is not None else None
        sample_id = _sample_id(at(ids), {n: at(v) for n, v in where_l.items()}, c.batch, c.position)
        cells = {"step": step, "micro_batch": getattr(c, "micro_batch", None), "rank": getattr(c, "rank", None),
                 "sample": c.batch, "position": c.position, "token_id": token_id, "sample_id": sample_id,
                 "token": decode_token(tok, token_id), "grad_norm": c.grad_norm, "share": c.share,
                 "top_layers": format_top_layers(c.layer_norms, top_layers),
                 "signal": lead.signal if lead else None, "z": lead.z if lead else None}
        row = [cells[n] for n in BASE_COLUMNS[:1] + where + BASE_COLUMNS[1:]]  # follows the column order
        row += [at(ev[n])[c.batch][c.position] if n in ev else None for n in extras]
        row += [at(sv[n])[c.batch] if n in sv else None for n in samples]
        rows.append(row)
    return columns, rows


def _sample_id(ids: Any, where: dict[str, Any], row: int, position: int | None) -> str | None:
    """The fingerprint of the culprit's sample (its document, in a packed row); None without ids."""
    if ids is None:
        return None
    mask, docs = where.get("mask"), where.get("docs")
    return row_fingerprint(ids[row], None if mask is None else mask[row], None if docs is None else docs[row],
                           position)
