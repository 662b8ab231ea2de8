"""How a unit of the batch is named: one phrase for a sample, a packed document, an RL completion.

The console, the events table's summaries, the run page, the cause's sentence, the localizer's notes and
the highlight page all say who a culprit is; they say it with these functions, so a reader meets one name
for one unit (``sample 3``, ``micro-batch 1, sample 3``, ``document 2 (sample 0)``, ``completion 2 of
group 1, reward 0.25 (rank 1, sample 9)``). Pure functions of numbers and names: no torch.
"""
from __future__ import annotations

from typing import Any


def unit_label(sample: Any, micro_batch: int | None = None, document: int | None = None,
               rank: int | None = None) -> str:
    """``"sample 3"``, ``"micro-batch 1, sample 3"``, ``"rank 1, micro-batch 0, sample 3"``,
    ``"document 2 (sample 0)"``: a unit by its coordinates."""
    where = (f"rank {rank}, " if rank is not None else "") + \
        (f"micro-batch {micro_batch}, " if micro_batch is not None else "") + f"sample {sample}"
    return f"document {document} ({where})" if document is not None else where


def micro_batch_label(micro_batch: int | None) -> str:
    """``"micro-batch 2"``; ``"the batch"`` for a step of one micro-batch."""
    return f"micro-batch {micro_batch}" if micro_batch is not None else "the batch"


def completion_label(noun: str, index: Any, group: Any, where: str, reward: Any = None,
                     document: int | None = None) -> str:
    """``"completion 2 of group 1, reward 0.25 (sample 9)"``: an RL sample by its group and index, ``where``
    (a ``unit_label`` without the document) and the packed row's document in the brackets."""
    shown = f", reward {float(reward):.4g}" if reward is not None else ""
    doc = f", document {document}" if document is not None else ""
    return f"{noun} {index} of group {group}{shown} ({where}{doc})"


def row_label(row: dict[str, Any]) -> str:
    """A culprit-table row's unit (its ``rank``, ``micro_batch``, ``sample``, ``document``; an RL row's
    ``group``, ``index``, ``reward``): the name the console gave it."""
    where = unit_label(row.get("sample"), row.get("micro_batch"), None, row.get("rank"))
    if row.get("group") is not None and row.get("index") is not None:
        return completion_label("completion", row["index"], row["group"], where, row.get("reward"),
                                 row.get("document"))
    return unit_label(row.get("sample"), row.get("micro_batch"), row.get("document"), row.get("rank"))


def share_list(rows: list[dict[str, Any]], percent: bool = True) -> str:
    """``"micro-batch 1, sample 3 40%, sample 0 12%"``: per-sample shares (``sample_shares`` rows), each
    unit named as everywhere else."""
    fmt = (lambda s: f"{max(s, 0.0):.0%}") if percent else (lambda s: f"{s:.2f}")
    return ", ".join(f"{row_label(r)} {fmt(r['share'])}" for r in rows if r.get("share") is not None)
