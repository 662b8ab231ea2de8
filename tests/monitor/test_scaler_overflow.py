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
