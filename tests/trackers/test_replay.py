"""Replay without a server (``trackers/replay.py``): into a given tracker, and the CLI's message when
there is nothing to replay. Replays into the ORIGINAL run of a real MLflow server after an outage
are in ``tests/faults/test_trackers.py``."""
from __future__ import annotations

from gradloc_track.cli import main
from gradloc_track.trackers import MemoryTracker, replay_spool
from gradloc_track.trackers.spool import Spool


def test_replay_cli_names_the_fix_when_there_is_nothing_to_replay(tmp_path, capsys):
    assert main(["replay", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no spool/*.jsonl" in err and "pass the run directory" in err


def test_replay_into_a_given_tracker_sends_every_record_once(tmp_path):
    spool = Spool(tmp_path / "spool" / "x.jsonl", "x")
    spool.write("log_metrics", [{"a": 1.0, "tok": "nan"}, 0], "down", ts=5)
    spool.write("log_table", ["t", ["c"], [[2]], 0], "down", ts=6)
    spool.write("finish", ["failed"], "down", ts=7)
    target = MemoryTracker()
    assert replay_spool(tmp_path, target) == 2
    assert target.metrics == [(0, {"a": 1.0, "tok": "nan"})] and target.tables["t"]["rows"] == [[2]]
    assert target.finished is None  # a given tracker is not finished by the replay
