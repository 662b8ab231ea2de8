"""The watcher that tells a rank why it waits at the detector's all-gather (``monitor/rank_wait.py``): each
long wait warned once, a short one never, and a wait after a warned one warned again (review, stop 54: a
warning decided for a wait that had just ended could mark the next as warned). The 2-process case is
``tests/dist/test_skipped_step_dist.py``."""
from __future__ import annotations

import time
import warnings

from gradloc_track.monitor import rank_wait


def _wait_for_warning(caught: list, n: int) -> None:
    deadline = time.monotonic() + 30  # a bound, not a timing: the watcher polls every WARN_AFTER_S / 4
    while sum("gradloc-track" in str(w.message) for w in caught) < n and time.monotonic() < deadline:
        time.sleep(0.02)


def test_each_long_wait_is_warned_once_and_a_short_one_never(monkeypatch):
    monkeypatch.setattr(rank_wait, "WARN_AFTER_S", 0.2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with rank_wait.waiting("rank 0's first wait"):
            _wait_for_warning(caught, 1)
            time.sleep(0.3)  # longer still: no second warning for the same wait
        with rank_wait.waiting("rank 0's short wait"):
            pass
        with rank_wait.waiting("rank 0's second wait"):
            _wait_for_warning(caught, 2)
    got = [str(w.message) for w in caught if "gradloc-track" in str(w.message)]
    assert [m.split(" has waited")[0] for m in got] == ["gradloc-track: rank 0's first wait",
                                                       "gradloc-track: rank 0's second wait"], got
    assert all("every rank must call optimizer.step()" in m for m in got)


def test_a_failed_gather_keeps_its_class_and_message_and_adds_the_likely_cause():
    class DistBackendLike(RuntimeError):
        pass

    err = rank_wait.explained(DistBackendLike("Timed out waiting 6000ms for send"), 1)
    assert type(err) is DistBackendLike
    assert str(err).startswith("Timed out waiting 6000ms for send [gradloc-track: rank 1's all-gather")
    assert "Likely cause" in str(err) and "skip optimizer.step()" in str(err)
