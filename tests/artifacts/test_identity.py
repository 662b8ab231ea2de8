"""``sample_id``: a fingerprint of a sample's loss-bearing token ids, its document's in a packed row."""
from __future__ import annotations

import hashlib
from types import SimpleNamespace

import torch

from gradloc_track.artifacts.identity import row_fingerprint, sample_fingerprint
from gradloc_track.artifacts.table import attribution_table
from gradloc_track.localizer.result import CulpritToken, LocateResult


def test_fingerprint_is_blake2b_of_the_ids_as_text():
    ids = [5, 17, 0, 63]
    assert sample_fingerprint(ids) == hashlib.blake2b(b"5 17 0 63", digest_size=8).hexdigest()
    assert sample_fingerprint(torch.tensor(ids)) == sample_fingerprint(ids) and len(sample_fingerprint(ids)) == 16
    assert sample_fingerprint([5, 17, 0]) != sample_fingerprint(ids)


def test_padding_and_prompt_positions_do_not_change_the_id():
    """Only the loss-bearing ids count: left or right padding, a masked prompt, the row it sits in."""
    answer = [11, 12, 13]
    right = row_fingerprint([1, 2] + answer + [0, 0], [0, 0, 1, 1, 1, 0, 0])
    left = row_fingerprint([0, 0, 0, 9] + answer, [0, 0, 0, 0, 1, 1, 1])
    assert right == left == sample_fingerprint(answer)


def test_a_packed_rows_document_is_fingerprinted_alone():
    ids = [3, 4, 5, 20, 21, 22, 23]
    docs = [0, 0, 0, 1, 1, 1, 1]
    mask = [1] * 7
    assert row_fingerprint(ids, mask, docs, position=4) == sample_fingerprint([20, 21, 22, 23])
    assert row_fingerprint(ids, mask, docs, position=0) == sample_fingerprint([3, 4, 5])
    assert row_fingerprint(ids, mask) == sample_fingerprint(ids)  # no document map: the whole row


def test_table_rows_name_their_sample_and_document():
    ids = torch.tensor([[3, 4, 5, 20, 21, 22], [7, 8, 9, 10, 11, 12]])  # (B, T): row 0 packs two documents
    mask = torch.ones(2, 6)
    ctx = SimpleNamespace(input_ids=ids, token_mask=mask, document_ids=torch.tensor([[0, 0, 0, 1, 1, 1]] * 2),
                          tokenizer=None, extra_columns={}, sample_columns={"dataset_index": [40, 41]})
    result = LocateResult([CulpritToken(0, 4, 1.0), CulpritToken(1, 0, 0.5)], probes=1, method="test",
                          threshold=0.1, total_norm=1.0)
    cols, rows = attribution_table(3, [], result, ctx)
    got = [dict(zip(cols, r)) for r in rows]
    assert [(r["sample_id"], r["dataset_index"]) for r in got] == [
        (sample_fingerprint([20, 21, 22]), 40), (sample_fingerprint([7, 8, 9]), 41)]
