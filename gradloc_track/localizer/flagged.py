"""Units a data signal flagged, named as culprits whatever their share of the gradient.

Some bad data is plain to a structural signal and faint in the gradient: a row whose targets are its
own input tokens (labels that leaked into the inputs, ``spikes.junk.leaked``) is easy to copy, and a
run of junk that the model rates below chance (``spikes.junk``) may move the step no more than a
clean row does. The share rules look for rows that stand out of the step's gradient and passed these
over while the cause named them ("no single culprit carries the gradient"). The monitor hands the
units its firing signals point at to the localizer (``LocateStep.flagged``, built by
``monitor.data_flags``); each is probed once, so its row carries its exact gradient norm and share like
any other culprit, with a note saying why it is named. A flagged span that covers most of its sample
(or of its packed document) is named as that sample (document), the level the share rules use.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from .culprit_view import CulpritView
from .levels import probe_unit
from .probe import BudgetExhausted
from .result import Culprit

WHOLE = 0.6  # a flagged span holding this share of its sample's (document's) terms names the sample


@dataclass(frozen=True)
class Flag:
    """A unit a data signal points at: micro-batch ``micro_batch`` (an index into the step's), row ``row``,
    positions ``[start, end)`` (None: the whole row), and why (``"leaked labels"``)."""

    micro_batch: int
    row: int
    start: int | None = None
    end: int | None = None
    reason: str = ""
    # the step fired on data signals alone (no gradient norm jumped): the flagged units are its answer, not
    # the samples that merely carry most of an ordinary gradient (``driver``: no naming by share then)
    alone: bool = False


def name_flagged(prober: Any, hits: Any, terms: list[list], flags: Sequence[Flag], named: list, labelled: bool,
                 docs: list | None, *, place: Callable[[Culprit], Culprit] = lambda c: c,
                 ) -> tuple[list[Culprit], list[str]]:
    """(culprits, notes): each flag not already covered by a named culprit (rows never overlap), probed as
    one unit at its level; ``place`` puts a row found in the search's numbering where its rank holds it
    (torch.distributed: ``dist_flagged``)."""
    out: list[Culprit] = []
    why: dict[str, list[str]] = {}
    taken = _taken(named, hits)
    whole = {c.micro_batch or 0 for c in named if c.level == "micro_batch"}
    for f in flags:
        if not 0 <= f.micro_batch < len(terms) or f.micro_batch in whole:
            continue
        doc_map = docs[f.micro_batch] if docs else None
        unit = _unit(f, terms[f.micro_batch], doc_map)
        if unit is None or any((f.micro_batch, f.row, t) in taken for t in unit[3]):
            continue
        level, document, (start, end), keys = unit
        try:
            c = probe_unit(prober, hits, f.micro_batch, [(f.row, t) for t in keys], level, labelled, batch=f.row,
                           start=start, end=end, document=document)
        except BudgetExhausted:
            return out, _notes(why) + ["the probe budget ran out before every flagged unit was probed"]
        if c.share is not None and not 0.0 <= c.share <= 1.0:  # named past floor_rows: within [0, 1] here
            c.raw_share, c.share = c.share, min(1.0, max(0.0, c.share))
        c = place(c)
        out.append(c)
        taken |= {(f.micro_batch, f.row, t) for t in keys}
        why.setdefault(f.reason or "a data signal", []).append(_who(c))
    return out, _notes(why)


def _taken(named: list, hits: Any) -> set:
    """(micro-batch index, row, position) of every term a named culprit covers."""
    out = set(hits.terms)  # the token hits' own keys
    for c in named:
        mb = c.micro_batch or 0
        if c.level == "token":
            out.add((mb, c.batch, c.position))
        elif c.batch is not None and c.start is not None:
            out |= {(mb, c.batch, t) for t in range(c.start, c.end)}
    return out


def _unit(f: Flag, mb_terms: list, doc_map: torch.Tensor | None) -> tuple | None:
    """(level, document, (start, end), positions) of a flag: the whole row, the packed document that the
    span mostly covers, the row when the span holds ``WHOLE`` of its terms, else the span itself."""
    row = sorted(t for b, t in mb_terms if b == f.row)
    if not row:
        return None
    lo, hi = (row[0], row[-1] + 1) if f.start is None else (f.start, f.end)
    span = [t for t in row if lo <= t < hi]
    if not span:
        return None
    if doc_map is not None:  # a packed row: a span lies in one document (a junk run never crosses one)
        d = int(doc_map[f.row, span[0]])
        doc = [t for t in row if int(doc_map[f.row, t]) == d]
        if len(span) >= WHOLE * len(doc):
            return "sample", d, (doc[0], doc[-1] + 1), doc
        return "span", None, (span[0], span[-1] + 1), span
    if len(span) >= WHOLE * len(row):
        return "sample", None, (row[0], row[-1] + 1), row
    return "span", None, (span[0], span[-1] + 1), span


def _who(c: Culprit) -> str:
    return CulpritView(None, None).words(c)  # the unit by its coordinates, named as everywhere else


def _notes(why: dict[str, list[str]]) -> list[str]:
    return [f"{'; '.join(units)}: named for {reason}, whatever their share of the step's gradient"
            for reason, units in why.items()]
