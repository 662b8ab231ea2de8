"""The user's extra columns for the culprit table, checked where they are handed over.

A column that shadows one of the table's own (``share``, ``sample``, ...) or holds another number of values
than the batch has samples (or positions) was dropped or left null in the table without a word: said at
once instead, naming the column and the fix (``SpikeContext``, ``set_loss_fn``, ``set_sample_info``).
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

# names the culprit table uses itself: a user column must not shadow them
TABLE_NAMES = ("step", "level", "token", "share", "grad_norm", "sample", "position", "end", "top_layers", "signal",
               "z", "token_id", "micro_batch", "rank", "document", "sample_id", "nonfinite", "data_fault")


# a context's sample column may say which rank each sample was on (the table's own ``rank``: a gathered view, verl)
SAMPLE_RANK = frozenset({"rank"})


def check_names(names: Any, kind: str = "sample", allowed: frozenset[str] = frozenset()) -> list[str]:
    """The column names, each a string the table does not use itself (but ``allowed``)."""
    out = []
    for name in names:
        if not isinstance(name, str) or not name:
            raise TypeError(f"gradloc-track: {kind} column names are non-empty strings; got {name!r}")
        if name in TABLE_NAMES and name not in allowed:
            raise ValueError(f"gradloc-track: {kind} column {name!r} would shadow the culprit table's own {name!r} "
                             f"column; rename it (e.g. 'user_{name}')")
        out.append(name)
    return out


def column_length(values: Any) -> int | None:
    """B of a column (a 1-D tensor/array, a list or tuple); None when it is not one (no host sync)."""
    if isinstance(values, torch.Tensor):
        return int(values.shape[0]) if values.dim() == 1 else None
    shape = getattr(values, "shape", None)
    if shape is not None:
        return int(shape[0]) if len(shape) == 1 else None
    return len(values) if isinstance(values, (list, tuple)) else None


def check_context_columns(sample_columns: Mapping[str, Any], extra_columns: Mapping[str, Any],
                          masks: Sequence[torch.Tensor], micro: bool) -> None:
    """A ``SpikeContext``'s columns against its masks: sample columns B values, token columns (B, T), per
    micro-batch (``micro``: each column a sequence of K, None for a micro-batch without it)."""
    check_names(sample_columns, "sample", SAMPLE_RANK)  # token columns may be the table's own (TRL's document)
    k = len(masks)
    for kind, columns in (("sample_columns", sample_columns), ("extra_columns", extra_columns)):
        if type(columns) is not dict:  # a lazy mapping (TRL's RL columns): computed only for a localized spike
            continue
        for name, values in columns.items():
            parts = values if micro else [values]
            if micro and (isinstance(values, torch.Tensor) or not isinstance(values, Sequence) or len(values) != k):
                raise ValueError(f"SpikeContext.{kind}[{name!r}]: with {k} micro-batch masks pass a sequence of {k} "
                                 f"(one per micro-batch, None where a micro-batch has none)")
            for j, (part, mask) in enumerate(zip(parts, masks)):
                if part is not None:
                    _check_part(kind, name, part, tuple(mask.shape), f" of micro-batch {j}" if micro else "")


def _check_part(kind: str, name: str, values: Any, bt: tuple[int, ...], where: str) -> None:
    if kind == "sample_columns":  # a row a sample (several values a sample, e.g. (B, 2), are one cell each)
        shape = _shape(values)
        n = shape[0] if shape else None
        if n != bt[0]:
            got = f"{n} values" if n is not None else f"a {type(values).__name__}"
            raise ValueError(f"SpikeContext.sample_columns[{name!r}]{where}: one value per sample, {bt[0]} (the "
                             f"token mask is {bt}); got {got}")
        return
    shape = _shape(values)
    if shape is not None and tuple(shape[:2]) != bt:
        raise ValueError(f"SpikeContext.extra_columns[{name!r}]{where}: one value per position, shape {bt} like the "
                         f"token mask; got {tuple(shape)} (a per-sample value goes in sample_columns)")


def _shape(values: Any) -> tuple[int, ...] | None:
    """The column's shape: an array's, or a list's length by its first entry's (B lists, tensors or arrays)."""
    shape = getattr(values, "shape", None)
    if shape is not None:
        return tuple(shape)
    if not isinstance(values, (list, tuple)):
        return None
    if values:
        first = _shape(values[0])
        if first:
            return (len(values), *first)
    return (len(values),)
