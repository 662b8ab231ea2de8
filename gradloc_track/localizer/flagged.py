"""Rows a structural data signal flagged, named as culprits whatever their share of the gradient.

A row whose targets are its own input tokens (labels that leaked into the inputs: ``spikes.junk.leaked``)
is bad data even when its gradient is small: a copied token is easy, so such rows pull the loss down
rather than the gradient up, and the share rules (which look for rows that stand out of the step's
gradient) pass them over while the cause names them. The context's ``leaked_labels`` sample column
(each row's leaked share, ``spikes.junk.LEAKED_COLUMN``) marks them; each is probed once, so its row in
the table carries its exact gradient norm and share like any other culprit.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from ..spikes.junk import LEAKED, LEAKED_COLUMN
from .probe import BudgetExhausted
from .result import Culprit


def flagged_rows(sample_columns: Mapping[str, Any], k: int) -> list[list[int]]:
    """Per micro-batch, the rows whose leaked share reaches ``LEAKED`` (none when the column is absent or
    does not fit the ``k`` micro-batches)."""
    col = sample_columns.get(LEAKED_COLUMN) if sample_columns else None
    if col is None:
        return [[] for _ in range(k)]
    parts = [col] if isinstance(col, torch.Tensor) else list(col)
    if len(parts) != k:
        return [[] for _ in range(k)]
    out = []
    for part in parts:
        vals = part.tolist() if isinstance(part, torch.Tensor) else list(part or [])  # host read: a spike step's
        out.append([b for b, v in enumerate(vals) if v is not None and v >= LEAKED])
    return out


def name_flagged(prober: Any, hits: Any, terms: list[list], flagged: list[list[int]], named: list,
                 labelled: bool) -> tuple[list[Culprit], list[str]]:
    """(culprits, notes): each flagged row not already covered by a named culprit (rows never overlap),
    probed as one sample unit."""
    covered = {(c.micro_batch or 0, c.batch) for c in named if c.batch is not None}
    whole = {c.micro_batch or 0 for c in named if c.level == "micro_batch"}
    out = []
    for i, rows in enumerate(flagged):
        for b in rows:
            row_terms = [(bb, t) for bb, t in terms[i] if bb == b]
            if not row_terms or i in whole or (i, b) in covered:
                continue
            try:
                g = prober.probe_terms(i, row_terms)
            except BudgetExhausted:
                return out, _note(out) + ["the probe budget ran out before every row with leaked labels was probed"]
            raw = hits.share(g)
            share = None if raw is None else min(1.0, max(0.0, raw))
            out.append(Culprit("sample", prober.norm(g), share, micro_batch=i if labelled else None, batch=b,
                               start=min(t for _, t in row_terms), end=max(t for _, t in row_terms) + 1,
                               n_terms=len(row_terms), layer_norms=prober.layer_norms(g),
                               raw_share=raw if raw != share else None))
            del g
    return out, _note(out)


def _note(rows: list[Culprit]) -> list[str]:
    if not rows:
        return []
    which = ", ".join((f"micro-batch {c.micro_batch} " if c.micro_batch is not None else "") + f"sample {c.batch}"
                      for c in rows)
    return [f"{which}: named for leaked labels (targets equal to their inputs at {LEAKED:.0%} or more of their "
            "terms), whatever their share of the step's gradient"]
