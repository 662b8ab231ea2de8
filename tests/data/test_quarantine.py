"""``logging_quarantine``: one warning however many samples it skips, every skip counted in the metric."""
from __future__ import annotations

import warnings

from gradloc_track.data.quarantine import logging_quarantine
from gradloc_track.trackers import MemoryTracker


def test_a_quarantine_warns_once_and_counts_every_skip_in_its_metric():
    tracker = MemoryTracker()
    q = logging_quarantine(tracker)
    q.blamed = {f"{i:016x}": 3 for i in range(50)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # every warning call shows: the count is ours, not the registry's
        admitted = [q.admit(f"{i % 60:016x}", step=10 + i // 60) for i in range(3000)]
    assert admitted.count(False) == q.skipped == 2500  # 50 of every 60 are blamed
    ours = [w for w in caught if "quarantine" in str(w.message)]
    assert [str(w.message) for w in ours] == [f"gradloc-track: quarantine: skipped sample {0:016x} (blamed for the "
                                              "spike at step 3) at step 10"]  # the first skip only
    logged = tracker.series("data/quarantine_skipped")
    assert logged[-1] == (10 + 2999 // 60, 2500.0) and len(logged) == 2500
