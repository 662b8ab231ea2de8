"""LM batches as the integrations capture them (``integrations/batches.py``): the step's own normaliser
(``num_items_in_batch``) kept, packed rows split into documents by their position ids."""
from __future__ import annotations

import torch

from gradloc_track.integrations.batches import LMBatch


def test_lm_batch_keeps_num_items_in_batch():
    ids = torch.zeros(2, 4, dtype=torch.long)
    b = LMBatch.from_call((), {"input_ids": ids, "labels": ids, "num_items_in_batch": torch.tensor(6)})
    assert int(b.num_items) == 6


def test_packed_rows_become_documents_from_position_ids():
    ids = torch.arange(12).view(2, 6)
    pos = torch.tensor([[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]])
    b = LMBatch.from_call((), {"input_ids": ids, "position_ids": pos})
    assert b.document_ids().tolist() == [[0, 0, 0, 1, 1, 2], [0, 0, 0, 0, 0, 0]]
    assert LMBatch.from_call((), {"input_ids": ids, "position_ids": pos[1:].expand(2, 6)}).document_ids() is None
