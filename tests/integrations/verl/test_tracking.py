"""``integrations/verl/tracking.py``: verl's door into the one handle and the one join: metrics held
for verl's output, artifacts into verl's run (joined through ``trackers.join`` and recorded in the
run dir, as every front door's run is), other ranks writing nothing."""
from __future__ import annotations

from .requires import verl  # noqa: F401  (first: the module is skipped where verl is missing)

import json

import pytest
import torch

from gradloc_track.integrations.handle import WatchHandle, open_handle
from gradloc_track.integrations.options import resolve_options
from gradloc_track.integrations.verl.tracking import VerlMetrics, verl_door
from gradloc_track.trackers.interface import NullTracker
from gradloc_track.trackers.join import Run
from gradloc_track.trackers.memory_tracker import MemoryTracker


def _handle(rank: int, **options) -> WatchHandle:
    model = torch.nn.Linear(4, 4)
    opts = resolve_options(spikes=False, **options)
    return open_handle(model, torch.optim.AdamW(model.parameters()), opts, verl_door(opts, rank))


def test_metrics_wait_for_verl_everything_else_goes_through():
    inner = MemoryTracker()
    t = VerlMetrics(inner)
    t.log_metrics({"grad_norm/global": 2}, 3)
    t.log_table("spikes/tokens", ["a"], [[1]], 3)
    t.set_tags({"spike_count": "1"})
    assert t.take() == {"grad_norm/global": 2.0} and t.take() == {}
    assert inner.keys() == set()  # no metric reached the joined run: verl's Tracking logs them
    assert inner.tables and inner.tags == {"spike_count": "1"}


def test_other_ranks_write_nothing(monkeypatch):
    monkeypatch.setenv("MLFLOW_RUN_ID", "not-joined-on-rank-1")
    handle = _handle(1)
    assert isinstance(handle.tracker, VerlMetrics) and isinstance(handle.tracker.inner, NullTracker)
    handle.close()
    assert not handle.optimizer._optimizer_step_pre_hooks  # close() took every hook off (the skip guard's)


def test_joins_the_mlflow_run_verls_tracking_names_and_records_it(tmp_path, monkeypatch, capsys, mlflow_db):
    mlflow = pytest.importorskip("mlflow")
    uri = mlflow_db
    client = mlflow.tracking.MlflowClient(uri)
    run = client.create_run(client.create_experiment("verl"))
    monkeypatch.setenv("MLFLOW_RUN_ID", run.info.run_id)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    handle = _handle(0, run_dir=str(tmp_path / "run"))
    assert type(handle) is WatchHandle and isinstance(handle.run, Run) and handle.run.joined == ("mlflow",)
    assert isinstance(handle.tracker, VerlMetrics)
    handle.tracker.log_html("spikes/highlight", "<p>x</p>", 1)
    handle.close()
    assert client.get_run(run.info.run_id).info.status == "RUNNING"  # verl's run: left open for verl
    assert [a.path for a in client.list_artifacts(run.info.run_id, "spikes")]
    record = json.loads((tmp_path / "run" / "tracker" / "mlflow.json").read_text())
    assert record["spec"]["joined"] is True and record["view"]["run_id"] == run.info.run_id  # report/culprits
    assert "verl's engine session joined MLflow run" in capsys.readouterr().err


def test_the_run_open_in_this_process_comes_first(tmp_path, monkeypatch, mlflow_db):
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    mlflow.set_tracking_uri(mlflow_db)
    with mlflow.start_run() as active:  # what verl's Tracking does in its process
        monkeypatch.setenv("MLFLOW_RUN_ID", "an-id-for-another-process")
        handle = _handle(0, run_dir=str(tmp_path / "run"))
        handle.close()
    record = json.loads((tmp_path / "run" / "tracker" / "mlflow.json").read_text())
    assert handle.run.joined == ("mlflow",) and record["view"]["run_id"] == active.info.run_id


def test_without_a_run_it_says_so(monkeypatch):
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    with pytest.warns(UserWarning, match="MLFLOW_RUN_ID"):
        handle = _handle(0)
    assert isinstance(handle.tracker.inner, NullTracker)
    handle.close()
