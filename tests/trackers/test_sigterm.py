"""SIGTERM (``trackers/sigterm.py``): open runs end as KILLED, then the previous handler runs; ours is
installed only while a run is open, and only from the main thread. The same against a real MLflow
server, in a process that dies of the signal, is in ``tests/faults/test_trackers.py``."""
from __future__ import annotations

import json
import os
import signal
import threading
import time

from gradloc_track.config import TrackerConfig
from gradloc_track.trackers import make_tracker, sigterm


def test_sigterm_finishes_killed_and_chains_to_the_previous_handler(tmp_path):
    called = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: called.append(signum))
    try:
        tracker = make_tracker(TrackerConfig(kind="none"), run_dir=tmp_path)
        assert signal.getsignal(signal.SIGTERM) is sigterm._handler
        tracker.log_metrics({"x": 1.0}, 0)
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 10
        while not called and time.monotonic() < deadline:
            time.sleep(0.01)
        assert called == [signal.SIGTERM]  # the handler installed before ours still ran
        assert json.loads((tmp_path / "tags.json").read_text())["status"] == "killed"
        assert signal.getsignal(signal.SIGTERM) is not sigterm._handler  # ours is gone with the run
        tracker.log_metrics({"x": 2.0}, 1)  # after the run ended: never raises
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_handler_is_installed_only_while_a_run_is_open(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    tracker = make_tracker(TrackerConfig(kind="none"), run_dir=tmp_path)
    assert signal.getsignal(signal.SIGTERM) is sigterm._handler
    tracker.finish()
    assert signal.getsignal(signal.SIGTERM) is before
    done = []
    t = threading.Thread(target=lambda: done.append(make_tracker(TrackerConfig(kind="none"), run_dir=tmp_path / "t")))
    t.start()
    t.join()
    assert signal.getsignal(signal.SIGTERM) is before  # not from another thread
    done[0].finish()
