"""``data/fingerprint.record_fingerprint``: an HF-style record's ``sample_id``, checked against the
fingerprint computed by hand (BLAKE2b-8 of the loss-bearing ids as decimal text), for labels,
input_ids with and without a mask, tensors and lists; and the errors that point at ``key=``."""
from __future__ import annotations

import hashlib

import pytest
import torch

from gradloc_track.artifacts.identity import sample_fingerprint
from gradloc_track.data.fingerprint import record_fingerprint


def by_hand(ids: list[int]) -> str:
    return hashlib.blake2b(" ".join(map(str, ids)).encode(), digest_size=8).hexdigest()


def test_record_fingerprint_is_the_tables_sample_id():
    """(moved here from tests/data/test_data.py)"""
    rec = {"input_ids": [1, 2, 5, 6], "labels": [-100, -100, 5, 6]}
    assert record_fingerprint(rec) == sample_fingerprint([5, 6])
    no_labels = {"input_ids": torch.tensor([9, 5, 6, 0]), "attention_mask": torch.tensor([1, 1, 1, 0])}
    assert record_fingerprint(no_labels) == sample_fingerprint([5, 6])  # input_ids[1:] without padding


@pytest.mark.parametrize("as_tensor", [False, True])
def test_labels_drop_the_first_term_and_every_masked_one(as_tensor):
    labels = [7, -100, 3, -100, 4, 4]
    rec = {"labels": torch.tensor(labels) if as_tensor else labels, "input_ids": [0] * 6}  # ids are not read
    assert record_fingerprint(rec) == by_hand([3, 4, 4])


def test_input_ids_without_a_mask_use_every_id_after_the_first():
    assert record_fingerprint({"input_ids": [10, 11, 12]}) == by_hand([11, 12])
    assert record_fingerprint({"input_ids": [10, 11], "labels": None, "attention_mask": None}) == by_hand([11])


def test_the_mask_is_read_at_the_same_shifted_positions():
    rec = {"input_ids": torch.tensor([1, 2, 3, 4, 5]), "attention_mask": [1, 0, 1, 0, 1]}
    assert record_fingerprint(rec) == by_hand([3, 5])


def test_a_record_with_no_loss_term_is_the_empty_fingerprint():
    assert record_fingerprint({"labels": [-100, -100]}) == by_hand([]) == record_fingerprint({"input_ids": [1]})


def test_the_same_ids_give_the_same_id_and_one_more_token_another():
    a = record_fingerprint({"labels": [-100, 5, 6]})
    assert a == record_fingerprint({"input_ids": torch.tensor([[0, 5, 6]])[0]})  # the collator's way to the same ids
    assert a != record_fingerprint({"labels": [-100, 5, 6, 6]})


def test_what_it_cannot_read_points_at_key():
    with pytest.raises(TypeError, match=r"a list is not a mapping.*pass key="):
        record_fingerprint([1, 2, 3])
    with pytest.raises(KeyError, match=r"neither labels nor input_ids \(its keys: \['text'\]\).*key="):
        record_fingerprint({"text": "hi"})
