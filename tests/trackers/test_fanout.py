"""Fan-out (``trackers/fanout.py``, ``tracker=both``): one bound shared by every backend; a list of
trackers becomes one tracker."""
from __future__ import annotations

import time
import warnings

from gradloc_track.trackers import FanoutTracker, MemoryTracker, as_one_tracker, read_spool
from gradloc_track.trackers.async_writer import AsyncTracker, WriterSettings
from gradloc_track.trackers.run_lock import RunOwner

from .faults import Hangs


def test_fanout_finish_shares_one_bound_between_hung_backends(tmp_path):
    """tracker=both under SIGTERM: the two backends share the grace period, so the second one
    still spools its records and status before the handler gives up."""
    backends, run = [Hangs(), Hangs()], RunOwner()  # the two writers of one run share its directory
    settings = WriterSettings(call_timeout_s=30.0, flush_interval_s=0.01)
    children = [AsyncTracker(lambda b=b: b, f"hung{i}", tmp_path, settings, owner=run) for i, b in enumerate(backends)]
    both = FanoutTracker(children)
    for step in range(6):
        both.log_metrics({"x": float(step)}, step)
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        both.finish("killed", timeout_s=2.0)
    took = time.perf_counter() - t0
    for b in backends:
        b.release.set()
    assert took < 2.0 + 3.0, f"finish() took {took:.1f} s for a 2 s bound shared by both backends"
    for i in range(2):
        recs = read_spool(tmp_path / "spool" / f"hung{i}.jsonl")
        assert [r["call"] for r in recs][-1] == "finish" and recs[-1]["args"] == ["killed"]


def test_a_list_of_trackers_becomes_one_tracker():
    a, b = MemoryTracker(), MemoryTracker()
    assert as_one_tracker([]) is None
    assert as_one_tracker([a]) is a
    both = as_one_tracker([a, b])
    assert isinstance(both, FanoutTracker) and both.trackers == [a, b]
    both.log_metrics({"x": 1.0}, 3)
    both.finish("failed", timeout_s=1.0)
    assert a.metrics == b.metrics == [(3, {"x": 1.0})] and a.finished == b.finished == "failed"
