"""``integrations/verl/tracking.py``: metrics held for verl's output; artifacts into verl's run."""
from __future__ import annotations

import pytest

from gradloc_track.integrations.options import resolve_options
from gradloc_track.integrations.verl.tracking import VerlMetrics, join_verl_run
from gradloc_track.trackers.interface import NullTracker
from gradloc_track.trackers.memory_tracker import MemoryTracker


def test_metrics_wait_for_verl_everything_else_goes_through():
    inner = MemoryTracker()
    t = VerlMetrics(inner)
    t.log_metrics({"grad_norm/global": 2}, 3)
    t.log_table("spikes/tokens", ["a"], [[1]], 3)
    t.set_tags({"spike_count": "1"})
    assert t.take() == {"grad_norm/global": 2.0} and t.take() == {}
    assert inner.keys() == set()  # no metric reached the joined run: verl's Tracking logs them
    assert inner.tables and inner.tags == {"spike_count": "1"}


def test_other_ranks_write_nothing(tmp_path):
    tracker, owns = join_verl_run(resolve_options(), 1, tmp_path)
    assert isinstance(tracker, NullTracker) and owns


def test_joins_the_mlflow_run_verls_tracking_names(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    uri = f"sqlite:///{tmp_path}/m.db"
    client = mlflow.tracking.MlflowClient(uri)
    run = client.create_run(client.create_experiment("verl"))
    monkeypatch.setenv("MLFLOW_RUN_ID", run.info.run_id)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    tracker, owns = join_verl_run(resolve_options(), 0, tmp_path / "run")
    tracker.log_html("spikes/highlight", "<p>x</p>", 1)
    tracker.finish()
    assert owns
    assert client.get_run(run.info.run_id).info.status == "RUNNING"  # verl's run: left open for verl
    assert [a.path for a in client.list_artifacts(run.info.run_id, "spikes")]


def test_without_a_run_it_says_so(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    with pytest.warns(UserWarning, match="MLFLOW_RUN_ID"):
        tracker, _ = join_verl_run(resolve_options(), 0, tmp_path)
    assert isinstance(tracker, NullTracker)
