"""An MLflow artifact store that refuses writes while the tracking store takes them (held-out tester, stop 64).

A read-only artifact folder (or a bucket without write permission, a server whose ``--artifacts-destination``
fails) took the whole backend down at the first spike file: every metric after it went to the spool, the run
stayed RUNNING, and ``replay`` stopped at the first spooled record, sending nothing. Now only the spike files wait
in the spool. A real SQLite store whose experiment's artifact folder cannot be made (a file stands where it
should be: refused for root too), the SDK with its defaults.
"""
from __future__ import annotations

import json
import warnings

from mlflow.tracking import MlflowClient

from gradloc_track.cli import main
from gradloc_track.config import TrackerConfig
from gradloc_track.trackers import make_tracker


def test_metrics_and_the_status_go_on_while_the_spike_files_wait_for_the_artifact_store(tmp_path, sqlite_uri,
                                                                                       capsys):
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where the artifact folder should be")
    client = MlflowClient(sqlite_uri)
    client.create_experiment("refusing", artifact_location=(blocker / "art").as_uri())
    cfg = TrackerConfig(kind="mlflow")
    cfg.mlflow.tracking_uri, cfg.mlflow.experiment_name = sqlite_uri, "refusing"
    run = tmp_path / "run"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tracker = make_tracker(cfg, run_dir=run, run_name="r")
        for step in range(10):
            tracker.log_metrics({"loss": float(step)}, step)
            if step == 5:
                tracker.log_table("spikes/tokens", ["step", "token"], [[5, "x"]], 5)
                tracker.log_html("spikes/highlight", "<p>x</p>", 5)
        tracker.finish("success")
    run_id = json.loads((run / "tracker" / "mlflow.json").read_text())["view"]["run_id"]
    got = client.get_run(run_id)
    assert got.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run_id, "loss")] == list(range(10))
    spooled = [json.loads(line)["call"] for line in (run / "spool" / "mlflow.jsonl").read_text().splitlines()]
    assert spooled == ["log_table", "log_html"]
    said = " | ".join(str(w.message) for w in caught)
    assert f"artifact store at {got.info.artifact_uri} did not take a write" in said and "metrics, params" in said
    assert "tracker failed" not in said  # (the whole-backend warning)
    err = capsys.readouterr().err
    assert f"did not take this run's spike files into its artifact store {got.info.artifact_uri}" in err
    assert "# once its artifact store takes writes" in err

    # replay against the same store: the records stay, said, exit 1; once the store takes writes they go
    assert main(["replay", str(run)]) == 1
    assert "2 spike file record(s) (tables, highlight pages, images) stay in the spool" in capsys.readouterr().err
    blocker.unlink()
    blocker.mkdir()
    assert main(["replay", str(run)]) == 0
    assert "replayed 2 record(s)" in capsys.readouterr().out
    assert sorted(a.path for a in client.list_artifacts(run_id, "spikes")) == ["spikes/highlight", "spikes/tokens"]
    assert client.get_run(run_id).info.status == "FINISHED"


def test_a_spike_file_that_fails_on_its_own_does_not_hold_back_the_others_in_a_replay(tmp_path, sqlite_uri, capsys):
    """Review, stop 64: after the first refused record replay tried no other one, and blamed the store: a heatmap
    whose file was gone held every spike file after it in the spool, on every replay. Two refusals in a row are the
    store's; one between records that go is the record's own."""
    from gradloc_track.trackers.spool import Spool

    cfg = TrackerConfig(kind="mlflow")
    cfg.mlflow.tracking_uri = sqlite_uri
    run = tmp_path / "run"
    tracker = make_tracker(cfg, run_dir=run, run_name="r")
    tracker.log_metrics({"loss": 1.0}, 0)
    tracker.finish("success")
    spool = Spool(run / "spool" / "mlflow.jsonl", "mlflow")
    spool.write("log_image", ["spikes/heatmap", str(tmp_path / "gone.png"), 5], "outage")
    spool.write("log_table", ["spikes/tokens", ["step", "token"], [[5, "x"]], 5], "outage")
    spool.write("log_html", ["spikes/highlight", "<p>x</p>", 5], "outage")
    assert main(["replay", str(run)]) == 1
    err = capsys.readouterr().err
    assert "1 spike file record(s)" in err and "the record itself failed: the other spike files went" in err
    run_id = json.loads((run / "tracker" / "mlflow.json").read_text())["view"]["run_id"]
    assert sorted(a.path for a in MlflowClient(sqlite_uri).list_artifacts(run_id, "spikes")) == [
        "spikes/highlight", "spikes/tokens"]
