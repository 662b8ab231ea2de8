"""A record's fingerprint, computed the way the culprit table computes ``sample_id``.

The table fingerprints a sample's loss-bearing ids (``artifacts.identity``). For an HF-style record
that is ``labels[1:]`` without -100 (each term predicts the next token); a record with no labels
(the collator copies ``input_ids`` to labels and masks padding) uses ``input_ids[1:]`` where
``attention_mask`` is set. Anything else: pass your own ``key=`` to the filters.
"""
from __future__ import annotations

from typing import Any, Mapping

from ..artifacts.identity import sample_fingerprint


def _ints(v: Any) -> list[int]:
    return [int(t) for t in (v.tolist() if hasattr(v, "tolist") else v)]  # host sync for a device tensor


def record_fingerprint(record: Mapping[str, Any]) -> str:
    """The ``sample_id`` of an HF-style record (``labels`` or ``input_ids``; see the module doc)."""
    if not isinstance(record, Mapping):
        raise TypeError(f"record_fingerprint: a {type(record).__name__} is not a mapping with labels/input_ids; "
                        "pass key=<function returning the sample's fingerprint> to the filter")
    if record.get("labels") is not None:
        return sample_fingerprint(t for t in _ints(record["labels"])[1:] if t != -100)
    if record.get("input_ids") is None:
        raise KeyError(f"record_fingerprint: the record has neither labels nor input_ids (its keys: "
                       f"{sorted(record)}); pass key=<function returning the sample's fingerprint>")
    ids = _ints(record["input_ids"])
    att = _ints(record["attention_mask"]) if record.get("attention_mask") is not None else [1] * len(ids)
    return sample_fingerprint(t for t, a in zip(ids[1:], att[1:]) if a)
