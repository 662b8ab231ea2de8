"""Flagged units across ranks: the units a data signal points at (``flagged.Flag``: leaked labels, a junk
run), named under torch.distributed as in one process.

Each rank's monitor flags rows of its OWN batch. One ``all_gather_object`` gives every rank every
rank's flags; they are numbered as the search numbers rows (``dist_terms.GlobalTerms``: one global
micro-batch), and ``flagged.name_flagged`` probes each once, in lockstep on every rank (every probe is
a collective), so the result is the same everywhere. A row is then placed back on its rank, micro-batch
and own row. Flags inside a piece named as a whole micro-batch are left out, as one process leaves
those inside a named micro-batch.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch.distributed as dist

from .flagged import Flag, name_flagged


def gather_flags(flags: Sequence[Flag], group: Any) -> list[list[Flag]]:
    """Every rank's flags, by rank (a collective: every rank calls it, flags or not)."""
    every: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, list(flags), group=group)
    return [list(f or []) for f in every]


def global_flags(every: list[list[Flag]], glob: Any, pieces_named: set) -> list[Flag]:
    """The flags on global rows (``glob.row_of``), those of rows with no loss term or in a named piece
    dropped."""
    out = []
    for r, flags in enumerate(every):
        for f in flags:
            row = glob.row_of.get((r, f.micro_batch, f.row))
            if row is not None and (r, f.micro_batch) not in pieces_named:
                out.append(Flag(0, row, f.start, f.end, f.reason, f.alone))
    return out


def document_map(glob: Any) -> dict:
    """``{(row, t): document}`` over the global rows that pack documents (what ``name_flagged`` reads as a
    micro-batch's document ids)."""
    return {(s.batch, t): s.document for s in glob.segments.items if s.document is not None for _, t in s.terms}


def name_flagged_everywhere(view: Any, hits: Any, glob: Any, flags: list[Flag], named: list,
                            labelled: bool) -> tuple[list, list[str]]:
    """``name_flagged`` over the global numbering, its rows placed on their ranks: flags on rows that pack
    documents read the documents, the others not, as one process reads each micro-batch's ids or none."""
    terms = [[(row, t) for _, row, t in glob.score]]
    docs = document_map(glob)
    packed = {row for row, _ in docs}
    out, notes = [], []
    for part, doc_map in (([f for f in flags if f.row in packed], [docs]),
                          ([f for f in flags if f.row not in packed], None)):
        if part:
            found, more = name_flagged(view, hits, terms, part, named, labelled, doc_map,
                                       place=lambda c: glob.place(c, labelled))
            out += found
            notes += more
    return out, notes
