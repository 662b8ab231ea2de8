"""Leave blocked samples out of the data: an HF ``datasets.Dataset`` (``filter_dataset``) and
torch datasets (``BlockedDataset``, ``BlockedIterableDataset``), each with a count of the drops.

``by="fingerprint"`` (the default) matches the sample's content (``data.record_fingerprint`` or
your ``key``): it works on any copy of the data, reordered or re-split. ``by="index"`` matches the
dataset index the ledger recorded (the record's ``index_column``, else its position): only valid
on the dataset the blamed runs read, in the same order. A record's index may be a python, numpy or
torch scalar (``with_format("torch")`` gives 0-d tensors): it is compared as a python value.

An HF dataset in any format (python, torch, numpy, arrow, pandas, ...) is filtered on its python
view (``with_format(None)``: ``key`` gets python lists and values) and handed back in its format.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from .blocklist import Blocklist
from .fingerprint import record_fingerprint

Key = Callable[[Any], str]


def _plain(value: Any, col: str) -> Any:
    """A record's index as a python value (a 0-d tensor or numpy scalar to its number)."""
    if hasattr(value, "tolist"):
        value = value.tolist()  # host sync for a device tensor: once per record, only for by="index"
    if isinstance(value, (list, dict)):
        raise ValueError(f"index_column={col!r} holds a {type(value).__name__} ({value!r:.60}), not a dataset "
                         "index; pass the column that holds each record's index (or by='fingerprint')")
    return value


def _match(blocklist: Any, by: str, key: Key | None, index_column: str | None) -> Callable[[Any, int], bool]:
    """``blocked(record, position)`` for ``by`` = fingerprint | index."""
    if by == "fingerprint":
        fp = key or record_fingerprint
        return lambda rec, pos: blocklist.blocks(fingerprint=fp(rec))
    if by == "index":
        col = index_column or getattr(blocklist, "index_column", "dataset_index")

        def by_index(rec: Any, pos: int) -> bool:
            has = isinstance(rec, dict) and col in rec
            return blocklist.blocks(index=_plain(rec[col], col) if has else pos)

        return by_index
    raise ValueError(f"by={by!r} is invalid: use by='fingerprint' (the sample's content) or by='index'")


def filter_dataset(dataset: Any, blocklist: Blocklist, *, by: str = "fingerprint", key: Key | None = None,
                   index_column: str | None = None, **filter_kwargs: Any) -> tuple[Any, int]:
    """``(kept, dropped)``: an HF ``datasets.Dataset`` (any format) without the blocked records
    (``Dataset.filter`` with ``batched=False``, on the python view), in the format it came in."""
    if not hasattr(dataset, "filter") or not hasattr(dataset, "__len__"):
        raise TypeError(f"filter_dataset takes a datasets.Dataset, not a {type(dataset).__name__}; wrap a torch "
                        "dataset with BlockedDataset or BlockedIterableDataset instead")
    if filter_kwargs.get("batched"):
        raise ValueError("filter_dataset checks one record at a time: leave out batched=True")
    blocked = _match(blocklist, by, key, index_column)
    fmt = getattr(dataset, "format", None) or {}
    plain = dataset.with_format(None) if fmt.get("type") is not None else dataset
    kept = plain.filter(lambda rec, pos: not blocked(rec, pos), with_indices=True, **filter_kwargs)
    if fmt.get("type") is not None:  # back in the caller's format
        kept = kept.with_format(fmt["type"], columns=fmt.get("columns"),
                                output_all_columns=fmt.get("output_all_columns", False), **fmt.get("format_kwargs", {}))
    return kept, len(dataset) - len(kept)


class BlockedDataset(torch.utils.data.Dataset):
    """A map-style dataset without the blocked samples (``dropped`` of them). Reads every sample
    once, up front, to know which to keep (so ``len`` is exact)."""

    def __init__(self, dataset: Any, blocklist: Blocklist, *, by: str = "fingerprint", key: Key | None = None,
                 index_column: str | None = None) -> None:
        blocked = _match(blocklist, by, key, index_column)
        self.dataset = dataset
        self.kept = [i for i in range(len(dataset)) if not blocked(dataset[i], i)]
        self.dropped = len(dataset) - len(self.kept)

    def __len__(self) -> int:
        return len(self.kept)

    def __getitem__(self, i: int) -> Any:
        return self.dataset[self.kept[i]]


class BlockedIterableDataset(torch.utils.data.IterableDataset):
    """A stream without the samples ``blocklist`` blocks, checked as each one comes (so a growing
    ``Quarantine`` works too). ``dropped`` counts them, ``on_drop(item, fingerprint)`` sees each.
    With DataLoader workers each worker has its own copy: the count is the main process's only
    with ``num_workers=0``."""

    def __init__(self, dataset: Any, blocklist: Any, *, key: Key | None = None,
                 on_drop: Callable[[Any, str], None] | None = None) -> None:
        self.dataset, self.blocklist = dataset, blocklist
        self.key = key or record_fingerprint
        self.on_drop = on_drop
        self.dropped = 0

    def __iter__(self):
        for item in self.dataset:
            fp = self.key(item)
            if self.blocklist.blocks(fingerprint=fp):
                self.dropped += 1
                if self.on_drop is not None:
                    self.on_drop(item, fp)
                continue
            yield item
