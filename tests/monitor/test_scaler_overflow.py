"""A loss scaler's routine overflow is no spike; a non-finite loss and a collapsing scale still are."""
from __future__ import annotations

import math

from gradloc_track.monitor.scaler_overflow import MAX_IN_A_ROW, ScalerOverflows


def test_overflows_with_a_finite_or_unknown_loss_are_routine_until_too_many_in_a_row():
    s = ScalerOverflows()
    assert [s.routine(False, 2.0) for _ in range(3)] == [True] * 3
    assert s.routine(True, 2.0) is False and s.in_a_row == 0  # a finite step ends the run of overflows
    got = [s.routine(False, None) for _ in range(MAX_IN_A_ROW + 1)]
    assert got == [True] * (MAX_IN_A_ROW - 1) + [False, False]  # the scale is collapsing: a spike again


def test_a_non_finite_loss_is_never_routine():
    s = ScalerOverflows()
    assert s.routine(False, math.nan) is False and s.routine(False, math.inf) is False


def test_the_overflows_in_a_row_go_on_after_a_resume():
    """Reviewer round 12: a resume started the count again, so a run resumed mid-collapse took 10 more."""
    import torch

    import gradloc_track
    from gradloc_track import MemoryTracker

    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    saved = gradloc_track.watch(model, opt, tracker=MemoryTracker(), console=False)
    saved.monitor.scaler_overflows.in_a_row = 7
    state = saved.state_dict()
    saved.finish()
    resumed = gradloc_track.watch(model, opt, tracker=MemoryTracker(), console=False)
    resumed.load_state_dict(state)
    overflows = resumed.monitor.scaler_overflows
    assert [overflows.routine(False, None) for _ in range(3)] == [True, True, False]  # the 10th in a row fires
    resumed.finish()

