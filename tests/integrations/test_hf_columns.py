"""``integrations/hf_columns``: rows gain their index, the collator keeps the named columns as lists
under one key and hands the model's own columns (by its forward's names, as Trainer would) to the
user's collator, and the model never sees the kept key. Each batch checked against the one written
out by hand; the default collator (transformers') is exercised by tests/integrations/test_sample_identity.py."""
from __future__ import annotations

import pytest
import torch

from gradloc_track.integrations.hf_columns import (INDEX_COLUMN, LABEL_COLUMNS, IndexedDataset, SampleInfoCollator,
                                                   keep_columns, with_index)
from gradloc_track.integrations.sample_info import SAMPLE_INFO_KEY


def as_lists(rows: list[dict]) -> dict:
    """A collator that shows what it was given: each column as a list."""
    return {k: [r[k] for r in rows] for k in rows[0]}


class HFStyle(torch.nn.Module):
    def forward(self, input_ids, attention_mask=None):
        return input_ids


class Opaque(torch.nn.Module):
    forward = None  # no readable signature


def test_with_index_adds_each_rows_index_without_touching_the_row():
    rows = [{"text": "a"}, {"text": "b"}]
    ds = with_index(rows)
    assert isinstance(ds, IndexedDataset) and len(ds) == 2
    assert [ds[i] for i in range(2)] == [{"text": "a", INDEX_COLUMN: 0}, {"text": "b", INDEX_COLUMN: 1}]
    assert rows == [{"text": "a"}, {"text": "b"}]
    assert with_index(rows, "row")[1] == {"text": "b", "row": 1}


def test_with_index_refuses_rows_that_are_not_mappings_and_names_it_takes():
    with pytest.raises(TypeError, match=r"row 0 is a list, not a mapping of columns"):
        with_index([[1, 2]])[0]
    with pytest.raises(ValueError, match="'sample' would shadow"):
        with_index([], "sample")


def test_the_kept_columns_go_under_one_key_as_plain_lists():
    collate = SampleInfoCollator(["dataset_index", "source"], as_lists, accepted={"input_ids", "labels"})
    batch = collate([{"input_ids": 1, "labels": 2, "dataset_index": torch.tensor(7), "source": "web", "junk": 0},
                     {"input_ids": 3, "labels": 4, "dataset_index": torch.tensor(8), "source": "book", "junk": 0}])
    assert batch == {"input_ids": [1, 3], "labels": [2, 4],
                     SAMPLE_INFO_KEY: {"dataset_index": [7, 8], "source": ["web", "book"]}}
    assert type(batch[SAMPLE_INFO_KEY]["dataset_index"][0]) is int  # a 0-d tensor becomes its python scalar
    vec = torch.arange(2)
    kept = SampleInfoCollator(["emb"], as_lists, accepted=None)([{"x": 1, "emb": vec}])
    assert kept["x"] == [1] and kept[SAMPLE_INFO_KEY]["emb"][0] is vec  # not 0-d: kept as it is


def test_a_missing_column_says_how_to_keep_what_trainer_drops():
    """(moved here from tests/integrations/test_sample_identity.py, with a hand-written model)"""
    collate = keep_columns(HFStyle(), "dataset_index", collator=as_lists)
    with pytest.raises(KeyError, match=r"no column\(s\) \['dataset_index'\].*remove_unused_columns=False.*with_index"):
        collate([{"input_ids": torch.arange(4), "labels": torch.arange(4)}])
    with pytest.raises(ValueError, match="'sample' would shadow"):
        keep_columns(HFStyle(), "sample")
    with pytest.raises(ValueError, match="name at least one column"):
        keep_columns(HFStyle())


def test_keep_columns_passes_on_what_the_forward_takes_and_the_labels():
    collate = keep_columns(HFStyle(), "source", collator=as_lists)
    assert set(LABEL_COLUMNS) <= collate.accepted and {"input_ids", "attention_mask"} <= collate.accepted
    batch = collate([{"input_ids": 1, "attention_mask": 1, "label": 0, "source": "a", "text": "raw"}])
    assert batch == {"input_ids": [1], "attention_mask": [1], "label": [0], SAMPLE_INFO_KEY: {"source": ["a"]}}
    opaque = keep_columns(Opaque(), "source", collator=as_lists)
    assert opaque.accepted is None
    assert opaque([{"text": "raw", "source": "a"}])["text"] == ["raw"]  # no signature: every column passed on


def test_keep_columns_hooks_the_model_so_its_forward_never_sees_the_key():
    model = HFStyle()
    keep_columns(model, "source", collator=as_lists)
    ids = torch.arange(3)
    assert torch.equal(model(input_ids=ids, **{SAMPLE_INFO_KEY: {"source": ["a"]}}), ids)
