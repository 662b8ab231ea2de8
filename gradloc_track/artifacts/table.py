"""The attribution table: one row per culprit of a spike event, at its level.

A token row is one loss term; a span, sample (or packed document) row holds the text of its loss
terms in ``token`` and its positions ``[position, end)``; a micro-batch row names only its
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

from .identity import row_fingerprint

if TYPE_CHECKING:
    from ..localizer.result import LocateResult
    from ..spikes.event import SpikeEvent

# what a reader scans first: when, at which level, which text, how much of the spike it carries;
# then where
# ``nonfinite``: True for a row the non-finite search named (its gradient or loss is NaN/Inf; share empty)
BASE_COLUMNS = ["step", "level", "token", "share", "grad_norm", "sample", "position", "end", "top_layers", "signal",
                "z", "token_id", "sample_id", "nonfinite"]
WHERE_COLUMNS = ("micro_batch", "rank", "document")  # only when the localization (or the context) has them
RANK_SAMPLE = "rank_sample"  # a gathered view's column (localizer.dist_context): the sample's index on its rank
MAX_UNIT_CHARS = 1000  # a span/sample row's text is cut here, with a marker saying how much was left


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


def where_columns(result: LocateResult, ctx: Any) -> list[str]:
    """``micro_batch`` for a step given as micro-batches, ``rank`` in a distributed run,
    ``document`` when the context marks packed documents: known from the setup, not from this
    event's culprits, so a run's first event (perhaps without culprits) fixes the right columns."""
    import torch.distributed as dist

    mb = getattr(ctx, "micro_batches", None) is not None or any(c.micro_batch is not None for c in result.culprits)
    rank = (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1) or \
        any(c.rank is not None for c in result.culprits)
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
    view = _View(ctx, extras, samples)
    lead = events[0] if events else None
    rows = []
    for c in result.culprits:
        cells = {"step": step, "level": c.level, "micro_batch": c.micro_batch, "rank": c.rank,
                 "document": view.document(c), "sample": view.sample(c), "position": c.start, "end": c.end,
                 "grad_norm": c.grad_norm, "share": c.share, "top_layers": format_top_layers(c.layer_norms, top_layers),
                 "signal": lead.signal if lead else None, "z": lead.z if lead else None,
                 "sample_id": view.sample_id(c), "nonfinite": bool(c.nonfinite), **view.text(c)}
        rows.append([cells[n] for n in columns[: len(columns) - len(extras) - len(samples)]] + view.columns(c))
    return columns, rows


class _View:
    """The context's ids and columns as python lists (one host sync per tensor, once per event)."""

    def __init__(self, ctx: Any, extras: list[str], samples: list[str]) -> None:
        ec = getattr(ctx, "extra_columns", None) or {}
        sc = getattr(ctx, "sample_columns", None) or {}
        ids_t = getattr(ctx, "input_ids", None)
        mask_t = getattr(ctx, "token_mask", None)
        self.ids = _cpu_lists({"ids": ids_t})["ids"] if ids_t is not None else None  # host sync
        self.mask = _cpu_lists({"m": mask_t})["m"] if mask_t is not None else None
        docs_t = getattr(ctx, "document_ids", None)
        self.docs = _cpu_lists({"d": docs_t})["d"] if docs_t is not None else None
        self.ev = _cpu_lists({n: ec[n] for n in extras if n in ec})
        self.sv = _cpu_lists({n: sc[n] for n in samples if n in sc})
        # a gathered view (torch.distributed) numbers its rows itself: the sample is the rank's own
        self.own = _cpu_lists({"s": sc[RANK_SAMPLE]})["s"] if RANK_SAMPLE in sc else None
        self.extras, self.samples = extras, samples
        self.tok = getattr(ctx, "tokenizer", None)
        import torch  # a table is built in a training process: torch is loaded already

        self.per_mb = not isinstance(mask_t, torch.Tensor)  # ctx holds K micro-batches

    def at(self, v: Any, mb: int | None) -> Any:
        """The micro-batch's entry of a per-micro-batch sequence."""
        return v[mb] if mb is not None and self.per_mb else v

    def sample_id(self, c: Any) -> str | None:
        """The fingerprint of the culprit's sample (its document, in a packed row); None without ids
        or for a micro-batch row."""
        if self.ids is None or c.batch is None:
            return None
        mask = self.at(self.mask, c.micro_batch) if self.mask is not None else None
        docs = self.at(self.docs, c.micro_batch) if self.docs is not None else None
        return row_fingerprint(self.at(self.ids, c.micro_batch)[c.batch], None if mask is None else mask[c.batch],
                               None if docs is None else docs[c.batch], c.start)

    def sample(self, c: Any) -> int | None:
        """The culprit's sample as the console names it: its index in its own rank's batch."""
        if self.own is None or c.batch is None:
            return c.batch
        return self.at(self.own, c.micro_batch)[c.batch]

    def document(self, c: Any) -> int | None:
        """The culprit's packed document: the localizer's for a unit, the map's at a token."""
        if c.document is not None or c.level != "token" or self.docs is None or c.batch is None:
            return c.document
        return int(self.at(self.docs, c.micro_batch)[c.batch][c.position])

    def text(self, c: Any) -> dict[str, Any]:
        """``token``/``token_id`` cells: the token, or a unit's loss-term text (cut at MAX_UNIT_CHARS)."""
        if self.ids is None or c.batch is None:
            return {"token": "", "token_id": None}
        row = self.at(self.ids, c.micro_batch)[c.batch]
        if c.level == "token":
            tid = int(row[c.position])
            return {"token": decode_token(self.tok, tid), "token_id": tid}
        ids = [int(row[p]) for p in self._terms(c, len(row))]
        return {"token": cut_text(decode_tokens(self.tok, ids)), "token_id": None}

    def columns(self, c: Any) -> list[Any]:
        """Per-token context columns (a token's value; a span's or sample's mean over its loss terms,
        e.g. an RL completion's advantage and mean ratio) and per-sample ones (rows with a sample)."""
        out = []
        for n in self.extras:
            if n not in self.ev or c.batch is None:
                out.append(None)
                continue
            row = self.at(self.ev[n], c.micro_batch)[c.batch]
            out.append(row[c.position] if c.level == "token" else self._unit_mean(c, row))
        for n in self.samples:
            cell = self.at(self.sv[n], c.micro_batch)[c.batch] if n in self.sv and c.batch is not None else None
            out.append(self._per_document(cell, c))
        return out

    def _per_document(self, cell: Any, c: Any) -> Any:
        """A packed row's per-document cell (one value per document, e.g. verl's responses' rewards):
        the culprit's document's value."""
        doc = self.document(c) if isinstance(cell, list) else None
        return cell[doc] if doc is not None and 0 <= doc < len(cell) else cell


    def _terms(self, c: Any, width: int) -> list[int]:
        """The positions of a unit's loss terms (every position without a mask)."""
        keep = self.at(self.mask, c.micro_batch)[c.batch] if self.mask is not None else [1] * width
        return [p for p in range(c.start, min(c.end, width)) if keep[p]]

    def _unit_mean(self, c: Any, row: list) -> float | None:
        """The mean of a per-token column over the unit's loss terms; None if not numeric or no term."""
        vals = [row[p] for p in self._terms(c, len(row))]
        if not vals or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals):
            return None
        return sum(float(v) for v in vals) / len(vals)


def decode_tokens(tokenizer: Any, ids: list[int]) -> str:
    """Several tokens' text, decoded together (so multi-byte characters come out whole)."""
    if tokenizer is None:
        return "".join(f"<{i}>" for i in ids)
    try:
        return str(tokenizer.decode([int(i) for i in ids]))
    except Exception:
        return "".join(decode_token(tokenizer, i) for i in ids)


def cut_text(text: str, limit: int = MAX_UNIT_CHARS) -> str:
    return text if len(text) <= limit else text[:limit] + f"…[+{len(text) - limit} chars]"
