"""The local run directory (``trackers/local_tracker.py``, ``tracker=none`` with a run dir): files
replaced atomically, and a full disk never stops training (the loss is counted and reported)."""
from __future__ import annotations

import json
import os

import pytest

from gradloc_track.config import TrackerConfig
from gradloc_track.trackers import LocalTracker, make_tracker

from .faults import train


def test_local_files_are_replaced_atomically(tmp_path, monkeypatch):
    tracker = LocalTracker(tmp_path)
    tracker.set_tags({"a": "1"})

    def crash(src, dst):
        raise OSError(5, "I/O error (injected: killed before the rename)")
    monkeypatch.setattr(os, "replace", crash)
    with pytest.warns(RuntimeWarning, match="cannot write"):
        tracker.set_tags({"b": "2"})  # never raises into training
    assert json.loads((tmp_path / "tags.json").read_text()) == {"a": "1"}  # the old file, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tags.json", "tracker"]  # no temp file left behind
    assert tracker.dropped == 1


def test_tracker_none_on_a_full_disk_never_stops_training(tmp_path, full_disk):
    disk, free = full_disk
    tracker = make_tracker(TrackerConfig(kind="none"), run_dir=disk / "run")
    with pytest.warns(RuntimeWarning, match="tracker/dropped"):
        train(tracker, steps=20)
    assert tracker.dropped >= 20
    lost = tracker.dropped
    free()
    tracker.log_metrics({"loss": 1.0}, 20)
    tracker.finish("success")
    lines = [json.loads(line) for line in (disk / "run" / "metrics.jsonl").read_text().splitlines()]
    assert lines[0] == {"step": 20, "metrics": {"loss": 1.0, "tracker/dropped": float(lost)}}
    assert json.loads((disk / "run" / "tags.json").read_text())["status"] == "success"
