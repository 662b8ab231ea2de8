"""An incident's aftermath step names no rows when most of the batch's rows carry it (a recovering model moves
every row: held-out tester, stop 52), and keeps the few rows a garbage batch inside a long recovery names
(review of b5baf6d: a restart's lr plateau put a garbled sample 40 steps on in the schedule's window)."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from gradloc_track.localizer.result import Culprit
from gradloc_track.localizer.step import LocateStep
from gradloc_track.monitor.responder import _most_rows


def _culprits(*rows: tuple[int | None, int]) -> SimpleNamespace:
    return SimpleNamespace(culprits=[Culprit("sample", 0.1, 1.0, micro_batch=mb, batch=b) for mb, b in rows])


def test_most_rows_counts_distinct_rows_against_the_batch():
    one = LocateStep(loss_fn=lambda m: m.sum(), token_mask=torch.ones(8, 4))
    assert _most_rows(_culprits(*[(None, b) for b in range(5)]), one, None)  # 5 of 8
    assert not _most_rows(_culprits((None, 1), (None, 1), (None, 4)), one, None)  # 2 rows of 8 (a span, a token)
    assert not _most_rows(_culprits(*[(None, b) for b in range(4)]), one, None)  # half: a garbage batch may be
    # micro-batches: rows add up
    two = LocateStep(loss_fn=[lambda m: m.sum()] * 2, token_mask=[torch.ones(4, 4), torch.ones(4, 4)])
    assert _most_rows(_culprits((0, 0), (0, 1), (1, 0), (1, 1), (1, 2)), two, None)
    assert not _most_rows(_culprits((0, 0), (1, 0)), two, None)
    mb = SimpleNamespace(culprits=[Culprit("micro_batch", 0.1, 1.0, micro_batch=1)])  # a micro-batch: its 4 rows
    assert not _most_rows(mb, two, None)
    mb.culprits.append(Culprit("sample", 0.1, 1.0, micro_batch=0, batch=2))  # and one more: 5 of 8
    assert _most_rows(mb, two, None)
