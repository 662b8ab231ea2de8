"""Per-sample metadata that travels with a micro-batch to the culprit table.

A culprit row names its sample by a content fingerprint (``artifacts.identity``) and by what the
user knows about it: the dataset index and any metadata (source, domain, reward, ...). Those
arrive per micro-batch, as columns of B values each, and become the spike context's
``sample_columns`` (one table column each, to group by in W&B and MLflow):

- a plain loop: ``handle.set_sample_info(dataset_index=idx, source=src)``, once per micro-batch;
- HF Trainer: ``hf.keep_columns(...)`` collates the columns under ``SAMPLE_INFO_KEY`` and the
  capture's forward pre-hook takes them out of the call, so the model never sees them.
"""
from __future__ import annotations

import warnings
from typing import Any, Mapping

import torch

from ..spikes.columns import TABLE_NAMES, check_names, column_length  # noqa: F401 (TABLE_NAMES: re-exported)

SAMPLE_INFO_KEY = "gradloc_sample_info"  # the batch key the collator helper puts the kept columns under


def check_columns(columns: Mapping[str, Any]) -> dict[str, Any]:
    """``{name: B values}`` checked for names and shape (B itself is checked against the batch)."""
    check_names(columns)
    for name, values in columns.items():
        if column_length(values) is None:
            raise TypeError(f"gradloc-track: sample column {name!r} must hold one value per sample (a 1-D tensor or "
                            f"a list); got {type(values).__name__}")
    return dict(columns)


def pop_sample_info(kwargs: dict) -> Any:
    """Take the collated sample columns out of a forward call's keyword arguments (None if absent)."""
    return kwargs.pop(SAMPLE_INFO_KEY, None)


def attach(batches: list, infos: list[dict[str, Any]]) -> None:
    """Pair ``set_sample_info`` calls with the step's captured micro-batches, one each, in order."""
    if not infos:
        return
    if len(infos) != len(batches):
        warnings.warn(f"gradloc-track: set_sample_info was called {len(infos)} time(s) for {len(batches)} captured "
                      "micro-batch(es) this step; its columns are left out. Call it once per micro-batch "
                      "(before or after that micro-batch's forward).", stacklevel=3)
        return
    for batch, info in zip(batches, infos):
        batch.info = {**(batch.info or {}), **info}


def sample_columns(batches: list) -> dict[str, Any]:
    """The spike context's ``sample_columns``: one micro-batch's columns as they are, several as
    sequences of K (a micro-batch without a column gets None cells). A column whose length is not
    the micro-batch's B is left out with a warning (its rows would be misattributed)."""
    infos = [_fitting(b) | _leaked(b) for b in batches]
    names = list(dict.fromkeys(n for info in infos for n in info))
    if len(batches) == 1:
        return dict(infos[0])
    return {n: [info.get(n, [None] * b.input_ids.shape[0]) for info, b in zip(infos, batches)] for n in names}


def _leaked(batch: Any) -> dict[str, Any]:
    """``leaked_labels``: each row's share of terms whose target is its own input token, when the junk
    statistics measured it and some row reaches ``spikes.junk.LEAKED`` (the cause names those rows)."""
    from ..spikes.junk import LEAKED, LEAKED_COLUMN

    rows = getattr(getattr(batch, "junk", None), "leak_rows", None)
    if rows is None or not bool((rows >= LEAKED).any()):  # host read: a spike step's, per micro-batch
        return {}
    return {LEAKED_COLUMN: rows}


def _fitting(batch: Any) -> dict[str, Any]:
    rows = int(batch.input_ids.shape[0])
    out = {}
    docs = None
    for name, values in (batch.info or {}).items():
        n = column_length(values)
        if n != rows:
            docs = _documents_per_row(batch) if docs is None else docs
            if docs and n == sum(docs):  # packed rows (DataCollatorWithFlattening): one value a document
                flat = values.tolist() if hasattr(values, "tolist") else list(values)
                ends = [sum(docs[: i + 1]) for i in range(len(docs))]
                out[name] = [flat[e - d: e] for e, d in zip(ends, docs)]  # a row's cell: its documents' values
                continue
            warnings.warn(f"gradloc-track: sample column {name!r} has {n} values for a micro-batch of {rows} "
                          f"samples{f' ({sum(docs)} packed documents)' if docs else ''}; it is left out of this "
                          "step's table", stacklevel=3)
            continue
        out[name] = values
    return out


def _documents_per_row(batch: Any) -> list[int]:
    """How many documents each row packs (``LMBatch.document_ids``: ``position_ids`` restarting at 0), [] without
    packing. A host read: once per spike, when a column's length is not the rows'."""
    docs = batch.document_ids() if hasattr(batch, "document_ids") else None
    return [] if docs is None else [int(v) + 1 for v in docs.max(1).values.tolist()]


def strip_sample_info(model: torch.nn.Module) -> Any:
    """A forward pre-hook that drops the collated columns from every call (evaluation, and training
    without the callback), so the model's forward never sees them. Returns the hook handle."""
    def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        if SAMPLE_INFO_KEY in kwargs:
            pop_sample_info(kwargs)
            return args, kwargs
        return None

    return model.register_forward_pre_hook(hook, with_kwargs=True)
