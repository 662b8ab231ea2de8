"""The attribution table: one row per culprit of a spike event, at its level.

A token row is one loss term; a span, sample (or packed document) row holds the text of its loss
terms in ``token`` and the positions they span ``[position, end)`` (a masked prompt or padding outside
them is not part of it); a micro-batch row names only its
micro-batch. Rows never overlap, so their ``share`` values add up.

Every row names its sample by ``sample_id``, the fingerprint of the sample's loss-bearing token
ids (``identity``: the same text gives the same id in any run; in a packed row with
``document_ids``, the culprit's document), next to the context's per-sample columns (dataset
index, source, ...).

The column names and ``cut_text`` are read by the ledger, which runs without torch: torch and the
localizer's types are imported where a table is built, not at import.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from ..text import decode_token
from .identity import row_fingerprint

if TYPE_CHECKING:
    from ..localizer.result import LocateResult
    from ..spikes.event import SpikeEvent

# what a reader scans first: when, at which level, which text, how much of the spike it carries;
# then where
# ``nonfinite``: True for a row the non-finite search named (its gradient or loss is NaN/Inf; share empty)
BASE_COLUMNS = ["step", "level", "token", "share", "grad_norm", "sample", "position", "end", "top_layers", "signal",
                "z", "token_id", "sample_id", "nonfinite", "data_fault"]
WHERE_COLUMNS = ("micro_batch", "rank", "document")  # only when the localization (or the context) has them
MAX_UNIT_CHARS = 1000  # a span/sample row's text is cut here, with a marker saying how much was left


def format_top_layers(layer_norms: dict[str, float], k: int = 3) -> str:
    """``"h.3:1.2e-01, lm_head:4.0e-02"``: the ``k`` layers this token's gradient hits hardest."""
    best = sorted(layer_norms.items(), key=lambda kv: -kv[1])[:k]
    return ", ".join(f"{name}:{val:.2e}" for name, val in best)


def where_columns(result: LocateResult, ctx: Any) -> list[str]:
    """``micro_batch`` for a step given as micro-batches, ``rank`` in a distributed run,
    ``document`` when the context marks packed documents: known from the setup, not from this
    event's culprits, so a run's first event (perhaps without culprits) fixes the right columns."""
    from ..norms import is_distributed  # (torch: loaded in a process that builds a table)

    mb = getattr(ctx, "micro_batches", None) is not None or any(c.micro_batch is not None for c in result.culprits)
    rank = is_distributed() or any(c.rank is not None for c in result.culprits)
    doc = getattr(ctx, "document_ids", None) is not None
    return [n for n, on in zip(WHERE_COLUMNS, (mb, rank, doc)) if on]


def attribution_table(step: int, events: Sequence[SpikeEvent], result: LocateResult, ctx: Any,
                      top_layers: int = 3, extra_columns: Sequence[str] | None = None,
                      sample_columns: Sequence[str] | None = None,
                      where: Sequence[str] | None = None) -> tuple[list[str], list[list[Any]]]:
    """(columns, rows), one row per culprit (``result.culprits``: coarse units, then tokens).

    ``extra_columns``/``sample_columns``/``where`` name the context and location columns to emit
    (default: those this result and ``ctx`` have); the writer fixes them at the first event so a
    growing table keeps one column set. Names absent from ``ctx`` give ``None`` cells.
    """
    ec = getattr(ctx, "extra_columns", None) or {}
    sc = getattr(ctx, "sample_columns", None) or {}
    extras = list(extra_columns if extra_columns is not None else ec)
    samples = list(sample_columns if sample_columns is not None else sc)
    where = list(where if where is not None else where_columns(result, ctx))
    taken = set(BASE_COLUMNS) | set(where)  # a context column named like ours (TRL's ``document``) is ours
    extras = [n for n in extras if n not in taken]
    samples = [n for n in samples if n not in taken and n not in extras]
    columns = BASE_COLUMNS[:2] + where + BASE_COLUMNS[2:] + extras + samples
    if not result.culprits:
        return columns, []
    from ..localizer.culprit_view import CulpritView  # torch is loaded in a process that builds a table

    from ..spikes.event import lead_event  # here: the report and the ledger read tables without torch

    view = CulpritView(result, ctx)
    lead = lead_event(events)
    rows = []
    for c in result.culprits:
        cells = {"step": step, "level": c.level, "micro_batch": c.micro_batch, "rank": c.rank,
                 "document": view.document(c),
                 "sample": view.own_sample(c.micro_batch, c.batch) if c.batch is not None else None,
                 "position": c.start, "end": c.end,
                 "grad_norm": c.grad_norm, "share": c.share, "top_layers": format_top_layers(c.layer_norms, top_layers),
                 "signal": lead.signal if lead else None, "z": lead.z if lead else None,
                 "sample_id": _sample_id(view, c), "nonfinite": bool(c.nonfinite),
                 "data_fault": _fault(lead, c), **_text(view, c)}
        rows.append([cells[n] for n in columns[: len(columns) - len(extras) - len(samples)]]
                    + _context_cells(view, c, extras, samples))
    return columns, rows


def _fault(lead: Any, c: Any) -> bool | None:
    """The row's ``data_fault``: the step's (``SpikeEvent.data_fault``), a ``numeric`` step's for its non-finite
    rows only (the finite rows beside them made no NaN)."""
    fault = getattr(lead, "data_fault", None)
    if fault and getattr(lead, "cause", None) == "numeric":
        return bool(c.nonfinite)
    return fault


def _sample_id(view: Any, c: Any) -> str | None:
    """The fingerprint of the culprit's sample (its document, in a packed row); None without ids
    or for a micro-batch row."""
    if c.batch is None:
        return None
    ids = view.row("input_ids", c.micro_batch, c.batch)
    if ids is None:
        return None
    return row_fingerprint(ids, view.row("token_mask", c.micro_batch, c.batch),
                           view.row("document_ids", c.micro_batch, c.batch), c.start)


def _text(view: Any, c: Any) -> dict[str, Any]:
    """``token``/``token_id`` cells: the token, or a unit's loss-term text (cut at MAX_UNIT_CHARS)."""
    ids = view.row("input_ids", c.micro_batch, c.batch) if c.batch is not None else None
    if ids is None:
        return {"token": "", "token_id": None}
    if c.level == "token":
        tid = int(ids[c.position])
        return {"token": decode_token(view.tokenizer, tid), "token_id": tid}
    return {"token": cut_text(view.text_at(c.micro_batch, c.batch, view.terms(c))), "token_id": None}


def _context_cells(view: Any, c: Any, extras: list[str], samples: list[str]) -> list[Any]:
    """Per-token context columns (a token's value; a span's or sample's mean over its loss terms,
    e.g. an RL completion's advantage and mean ratio) and per-sample ones (rows with a sample; a
    packed row's per-document cell: the culprit's document's value)."""
    out: list[Any] = []
    for n in extras:
        if c.batch is None or not view.has("extra_columns", n):
            out.append(None)
        elif c.level == "token":
            out.append(view.extra_row(n, c.micro_batch, c.batch)[c.position])
        else:
            out.append(view.mean_of(n, c.micro_batch, c.batch, view.terms(c)))
    for n in samples:
        has = c.batch is not None and view.has("sample_columns", n)
        out.append(view.sample_cell(n, c.micro_batch, c.batch, view.document(c)) if has else None)
    return out


def cut_text(text: str, limit: int = MAX_UNIT_CHARS) -> str:
    return text if len(text) <= limit else text[:limit] + f"…[+{len(text) - limit} chars]"
