"""Keep a sample's dataset index and metadata through ``transformers.Trainer`` to the culprit table.

Trainer drops every dataset column its model's ``forward`` does not take before the collator, so
an index or a ``source`` column never reaches a callback. With ``remove_unused_columns=False``,
``keep_columns`` collates the model's own columns as usual and the kept ones, as lists, under one
extra batch key; the callback's capture takes that key out of the forward call (and a hook on the
model drops it in every other call, evaluation included), so the model never sees it:

```python
ds = with_index(ds)                                   # each row gains "dataset_index"
Trainer(model, TrainingArguments(..., remove_unused_columns=False), train_dataset=ds,
        data_collator=keep_columns(model, "dataset_index", "source"),
        callbacks=[GradLocCallback()])
```
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Sequence

import torch

from .sample_info import SAMPLE_INFO_KEY, check_names, strip_sample_info

INDEX_COLUMN = "dataset_index"
LABEL_COLUMNS = ("label", "label_ids", "labels")  # Trainer keeps these whatever the signature says


class IndexedDataset(torch.utils.data.Dataset):
    """A map-style dataset whose rows (mappings) gain their index under ``column``."""

    def __init__(self, dataset: Any, column: str = INDEX_COLUMN) -> None:
        self.dataset, self.column = dataset, check_names([column])[0]

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> dict[str, Any]:
        row = self.dataset[i]
        if not hasattr(row, "keys"):
            raise TypeError(f"with_index: row {i} is a {type(row).__name__}, not a mapping of columns")
        return {**row, self.column: int(i)}


def with_index(dataset: Any, column: str = INDEX_COLUMN) -> IndexedDataset:
    """``dataset`` (any map-style dataset of mappings: a list, a ``datasets.Dataset``, a torch
    ``Dataset``) with each row's index under ``column``, for ``keep_columns``."""
    return IndexedDataset(dataset, column)


def _plain(value: Any) -> Any:
    """A table cell: a 0-d tensor/array becomes its python scalar."""
    item = getattr(value, "item", None)
    return item() if callable(item) and getattr(value, "ndim", 1) == 0 else value


class SampleInfoCollator:
    """Collate the model's columns with ``collator``; the kept ``columns`` go under
    ``SAMPLE_INFO_KEY`` as lists (B values each). Columns the model's ``forward`` does not take
    are dropped, as Trainer's ``remove_unused_columns`` would."""

    def __init__(self, columns: Sequence[str], collator: Callable | None, accepted: set[str] | None) -> None:
        if collator is None:
            from transformers import default_data_collator

            collator = default_data_collator
        self.columns, self.collator, self.accepted = list(columns), collator, accepted

    def __call__(self, features: list[dict[str, Any]]) -> Any:
        missing = [c for c in self.columns if c not in features[0]]
        if missing:
            raise KeyError(f"keep_columns: the batch has no column(s) {missing} (its columns: {sorted(features[0])}). "
                           "Trainer removes the columns its model does not take before the collator: pass "
                           "TrainingArguments(remove_unused_columns=False), and with_index(dataset) for "
                           f"{INDEX_COLUMN!r}")
        info = {c: [_plain(f[c]) for f in features] for c in self.columns}
        rest = [{k: v for k, v in f.items() if k not in info and (self.accepted is None or k in self.accepted)}
                for f in features]
        batch = self.collator(rest)
        batch[SAMPLE_INFO_KEY] = info
        return batch


def keep_columns(model: torch.nn.Module, *columns: str, collator: Callable | None = None) -> SampleInfoCollator:
    """A Trainer ``data_collator`` that keeps ``columns`` (the dataset index, source, domain, ...)
    for the culprit table: see the module doc. ``collator``: yours (default: Trainer's
    ``default_data_collator``). Also hooks ``model`` so its forward never receives the kept columns."""
    if not columns:
        raise ValueError("keep_columns(model, *columns): name at least one column, e.g. keep_columns(model, "
                         f"{INDEX_COLUMN!r}, 'source')")
    check_names(columns)
    strip_sample_info(model)
    try:
        accepted = set(inspect.signature(model.forward).parameters) | set(LABEL_COLUMNS)
    except (TypeError, ValueError):  # no readable signature: hand every other column to the collator
        accepted = None
    return SampleInfoCollator(columns, collator, accepted)
