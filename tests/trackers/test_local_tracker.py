"""The local run directory (``trackers/local_tracker.py``, ``tracker=none`` with a run dir): files
replaced atomically, and a full disk never stops training (the loss is counted and reported)."""
from __future__ import annotations

import json
import os


from gradloc_track.config import TrackerConfig
from gradloc_track.trackers import LocalTracker, make_tracker

from .faults import train


def test_local_files_are_replaced_atomically_and_a_failed_rewrite_is_kept(tmp_path, monkeypatch, capsys):
    tracker = LocalTracker(tmp_path)
    tracker.set_tags({"a": "1"})

    def crash(src, dst):
        raise OSError(5, "I/O error (injected: killed before the rename)")
    real = os.replace
    monkeypatch.setattr(os, "replace", crash)
    tracker.set_tags({"b": "2"})  # never raises into training
    assert json.loads((tmp_path / "tags.json").read_text()) == {"a": "1"}  # the old file, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["INCOMPLETE", "tags.json", "tracker"]  # no temp file
    assert "cannot write tags.json" in capsys.readouterr().err and tracker.dropped == 0  # kept, not lost
    monkeypatch.setattr(os, "replace", real)
    tracker.log_metrics({"loss": 1.0}, 0)  # room again: what waited goes too
    assert json.loads((tmp_path / "tags.json").read_text()) == {"a": "1", "b": "2"}
    tracker.finish("success")
    assert not (tmp_path / "INCOMPLETE").exists() and "it is complete" in capsys.readouterr().err


def test_tracker_none_on_a_full_disk_never_stops_training_and_loses_nothing(tmp_path, full_disk, capsys):
    disk, free = full_disk
    tracker = make_tracker(TrackerConfig(kind="none"), run_dir=disk / "run")
    train(tracker, steps=8)  # (a metrics line is ~1 KiB: 9 of them fit the 16 KiB disk once it has room)
    said = capsys.readouterr().err
    assert said.count("cannot write") == 1 and "the run dir is INCOMPLETE" in said  # at once, once
    assert tracker.dropped == 0  # kept in memory, not lost
    free()
    tracker.log_metrics({"loss": 1.0}, 8)
    tracker.finish("success")
    lines = [json.loads(line) for line in (disk / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [rec["step"] for rec in lines] == list(range(9)) and lines[-1]["metrics"] == {"loss": 1.0}
    assert json.loads((disk / "run" / "tags.json").read_text())["status"] == "success"
    assert "were all written by the end: it is complete" in capsys.readouterr().err
    assert not (disk / "run" / "INCOMPLETE").exists()


def test_metrics_by_step_merges_a_steps_lines(tmp_path):
    """A new user, stop 55: a spike step's metrics.jsonl has two lines (the culprit metrics in one of their
    own); read by step, the second line hid the first's keys."""
    from gradloc_track.trackers import LocalTracker, metrics_by_step, read_metrics

    t = LocalTracker(tmp_path)
    t.log_metrics({"grad_norm/global": 1.0, "loss": 2.0}, 170)
    t.log_metrics({"spike/culprits": 1.0}, 170)
    t.log_metrics({"grad_norm/global": 0.5}, 171)
    t.finish()
    assert len(read_metrics(tmp_path)) == 3
    assert metrics_by_step(tmp_path) == {170: {"grad_norm/global": 1.0, "loss": 2.0, "spike/culprits": 1.0},
                                         171: {"grad_norm/global": 0.5}}
