"""CulpritView: a localized spike's culprits over the batch they index, as the host reads them.

The events table, the highlight page, the console block and the cause's sentence all name culprits
and quote their text. They read them here, so a culprit has one name everywhere (``sample 3``,
``document 2 (sample 0)``, ``completion 2 of group 1, reward 0.25 (sample 9)``, ``rank 1,
micro-batch 3, sample 0``), its text is decoded one way, and "one entry per micro-batch, or one flat
batch" is decided once, from the context's ``token_mask`` (a list of K masks: K micro-batches; a
gathered view under torch.distributed is one flat batch even when its culprits name micro-batches).

A row is read to the host when a reader first asks for it (one host sync per row and field, on a
spike's outputs only), never the whole batch: a view of a multi-million-token batch reads the few
rows its culprits sit in.
"""
from __future__ import annotations

from typing import Any, Sequence

from ..text import decode_tokens
from ..units import completion_label, micro_batch_label, unit_label

RANK_SAMPLE = "rank_sample"  # a gathered view's column (``dist_context``): the sample's index on its rank


def _lists(value: Any) -> Any:
    """A tensor (or nested sequence of them) as python lists; anything else as it is."""
    if hasattr(value, "tolist"):
        return value.tolist()  # host sync: one per tensor
    if isinstance(value, (list, tuple)):
        return [_lists(v) for v in value]
    return value


class CulpritView:
    """The culprits of ``result`` over ``context`` (the ``SpikeContext`` they index: rank 0's gathered
    view under torch.distributed). ``context`` may be None: culprits are then named by coordinates.
    A user's context of its own shape is read by its field names, so it may lack any of them."""

    def __init__(self, result: Any, context: Any) -> None:
        self.result, self.context = result, context
        self.per_mb = isinstance(getattr(context, "token_mask", None), (list, tuple))
        self.tokenizer = getattr(context, "tokenizer", None)
        self._rows: dict[tuple, Any] = {}  # (field or column, micro-batch, sample) -> the row as python values

    # -- the context on the host, a row at a time -------------------------------------------------
    def at(self, value: Any, mb: int | None) -> Any:
        """The micro-batch ``mb``'s entry of a per-micro-batch value (the value itself in a flat batch)."""
        return value[mb] if self.per_mb and mb is not None and value is not None else value

    def _row(self, key: tuple, value: Any, mb: int | None, sample: int) -> Any:
        """``value``'s entry for ``sample`` (of ``mb``) as python values, read once (one host sync)."""
        key = (*key, mb if self.per_mb else None, sample)
        if key not in self._rows:
            part = self.at(value, mb)
            self._rows[key] = None if part is None else _lists(part[sample])
        return self._rows[key]

    def row(self, name: str, mb: int | None, sample: int) -> list | None:
        """Sample ``sample``'s row of a (B, T) context tensor (``input_ids``, ``token_mask``,
        ``document_ids``, ``segment_ids``); None when the context lacks it."""
        return self._row((name,), getattr(self.context, name, None), mb, sample)

    def columns(self, kind: str) -> dict[str, Any]:
        """The context's ``extra_columns`` or ``sample_columns`` as given ({} without)."""
        return getattr(self.context, kind, None) or {}

    def has(self, kind: str, name: str) -> bool:
        return name in self.columns(kind)

    def sample_cell(self, name: str, mb: int | None, sample: int, document: int | None = None) -> Any:
        """Sample ``sample``'s cell of the ``sample_columns`` column ``name``; a packed row's cell that
        holds one value per document (verl's responses' rewards): ``document``'s."""
        cell = self._row(("sample_columns", name), self.columns("sample_columns")[name], mb, sample)
        if document is not None and isinstance(cell, (list, tuple)) and 0 <= document < len(cell):
            cell = cell[document]
        return cell

    def extra_row(self, name: str, mb: int | None, sample: int) -> list | None:
        """Sample ``sample``'s row of the per-token ``extra_columns`` column ``name``."""
        cols = self.columns("extra_columns")
        return self._row(("extra_columns", name), cols[name], mb, sample) if name in cols else None

    # -- where a culprit is -----------------------------------------------------------------------
    def own_sample(self, mb: int | None, sample: int) -> int:
        """The sample's index in its own rank's batch (a gathered view numbers its rows itself)."""
        return int(self.sample_cell(RANK_SAMPLE, mb, sample)) if self.has("sample_columns", RANK_SAMPLE) else sample

    def document_at(self, mb: int | None, sample: int, position: int) -> int | None:
        docs = self.row("document_ids", mb, sample)
        return None if docs is None else int(docs[position])

    def document(self, c: Any) -> int | None:
        """The culprit's packed document: the localizer's for a unit, the map's at a token."""
        if c.document is not None or c.level != "token" or c.batch is None:
            return c.document
        return self.document_at(c.micro_batch, c.batch, c.position)

    def loss_positions(self, mb: int | None, sample: int, start: int, end: int,
                       document: int | None = None) -> list[int]:
        """The positions of ``[start, end)`` in ``sample`` that carry a loss term (of ``document``)."""
        mask = self.row("token_mask", mb, sample)
        width = len(mask) if mask is not None else end
        keep = [p for p in range(start, min(end, width)) if mask is None or mask[p] != 0]
        if document is not None and self.row("document_ids", mb, sample) is not None:
            keep = [p for p in keep if self.document_at(mb, sample, p) == document]
        return keep

    def terms(self, c: Any) -> list[int]:
        """A culprit's loss-term positions: a token's own, a unit's inside ``[start, end)``."""
        if c.level == "token":
            return [c.position]
        return self.loss_positions(c.micro_batch, c.batch, c.start, c.end, c.document)

    # -- who it is, what it says ------------------------------------------------------------------
    def noun(self) -> str:
        """What an RL sample's second part is called: ``segment_names`` ("prompt", "response") names
        verl's, TRL's ("prompt", "completion") and the default."""
        names = getattr(self.context, "segment_names", None)
        return str(names[1]) if names is not None and len(names) == 2 else "completion"

    def who(self, mb: int | None, sample: int, document: int | None = None) -> tuple[str, str]:
        """(label, unit): ``("completion 2 of group 1, reward 0.25 (sample 9)", "completion")``,
        ``("document 2 (sample 0)", "document")`` or ``("micro-batch 1, sample 3", "sample")``. A
        gathered view names the rank and the sample's index there (``rank``, ``rank_sample``)."""
        cols = self.columns("sample_columns") if self.context is not None else {}
        rank = self.sample_cell("rank", mb, sample, document) if "rank" in cols else None
        rl = {n: self.sample_cell(n, mb, sample, document) for n in ("group", "index", "reward") if n in cols}
        # an RL completion (TRL's GRPO, verl, examples/rl_grpo.py); a packed row's cells hold one value per
        # document, so the row as a whole is a sample
        if "group" in rl and "index" in rl and not any(isinstance(v, (list, tuple)) for v in rl.values()):
            where = unit_label(self.own_sample(mb, sample), mb, None, rank)
            return completion_label(self.noun(), rl["index"], rl["group"], where, rl.get("reward"), document), \
                self.noun()
        label = unit_label(self.own_sample(mb, sample), mb, document, rank)
        return label, "document" if document is not None else "sample"

    def words(self, c: Any) -> str:
        """A culprit in words, where in its unit included: ``"sample 3, token 40"``, ``"document 2
        (sample 0), span 3-9"``, ``"micro-batch 1"``."""
        if c.level == "micro_batch" or c.batch is None:
            return micro_batch_label(c.micro_batch)
        doc = self.document(c)
        label = self.who(c.micro_batch, c.batch, doc)[0] if self.context is not None else \
            unit_label(c.batch, c.micro_batch, doc, c.rank)  # no context: its coordinates
        if c.level == "token":
            return f"{label}, token {c.position}"
        return f"{label}, span {c.start}-{c.end - 1}" if c.level == "span" else label

    def decode(self, ids: Sequence[int]) -> str:
        """Token ids' text, decoded together (a character split over byte tokens comes out whole)."""
        return decode_tokens(self.tokenizer, list(ids))

    def text_at(self, mb: int | None, sample: int, positions: Sequence[int]) -> str:
        """The tokens at ``positions`` of ``sample``, decoded together; "" without ``input_ids``."""
        ids = self.row("input_ids", mb, sample)
        return "" if ids is None else self.decode([int(ids[p]) for p in positions])

    def mean_of(self, name: str, mb: int | None, sample: int, positions: Sequence[int]) -> float | None:
        """The mean of the per-token column ``name`` over ``positions``; None when it is not numeric,
        not a per-token row, or no position is given."""
        try:
            row = self.extra_row(name, mb, sample)
            vals = [row[p] for p in positions] if row is not None else []
        except (IndexError, TypeError, KeyError):  # a column of another shape
            return None
        if not vals or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals):
            return None
        return sum(float(v) for v in vals) / len(vals)
