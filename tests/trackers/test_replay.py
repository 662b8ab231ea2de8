"""Replay without a server (``trackers/replay.py``): into a given tracker, and the CLI's message when
there is nothing to replay. Replays into the ORIGINAL run of a real MLflow server after an outage
are in ``tests/faults/test_trackers.py``."""
from __future__ import annotations

import json

from gradloc_track.cli import main
from gradloc_track.trackers import MemoryTracker, replay_spool
from gradloc_track.trackers.spool import Spool


def test_replay_cli_names_the_fix_when_there_is_nothing_to_replay(tmp_path, capsys):
    assert main(["replay", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no spool/*.jsonl" in err and "pass the run directory" in err


def test_replay_of_a_tracker_none_run_dir_says_there_was_no_backend(tmp_path, capsys):
    """The run dir the training printed, of a tracker=none run: not "pass the run directory the training printed"
    (held-out tester round 3) but what it is, and the command that reads it."""
    from gradloc_track.config import TrackerConfig
    from gradloc_track.trackers import make_tracker

    tracker = make_tracker(TrackerConfig(kind="none"), run_dir=tmp_path)
    tracker.log_metrics({"loss": 1.0}, 0)
    tracker.finish()
    assert main(["replay", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "nothing to replay: this run logged to no tracker backend" in err and "pass the run directory" not in err
    assert f"gradloc-track report {tmp_path}" in err


def test_replay_into_a_given_tracker_sends_every_record_once(tmp_path):
    spool = Spool(tmp_path / "spool" / "x.jsonl", "x")
    spool.write("log_metrics", [{"a": 1.0, "tok": "nan"}, 0], "down", ts=5)
    spool.write("log_table", ["t", ["c"], [[2]], 0], "down", ts=6)
    spool.write("finish", ["failed"], "down", ts=7)
    target = MemoryTracker()
    assert replay_spool(tmp_path, target) == 2
    assert target.metrics == [(0, {"a": 1.0, "tok": "nan"})] and target.tables["t"]["rows"] == [[2]]
    assert target.finished is None  # a given tracker is not finished by the replay


def test_replay_of_a_sweep_folder_replays_each_run_dir_under_it(tmp_path, sqlite_uri, capsys):
    """``replay`` takes what ``culprits`` takes: a Hydra sweep's folder replays each of its runs (held-out tester
    round 3: it exited 2 there)."""
    from gradloc_track.config import TrackerConfig
    from gradloc_track.trackers import make_tracker

    cfg = TrackerConfig(kind="mlflow")
    cfg.mlflow.tracking_uri = sqlite_uri
    for job in ("0_clip=adagc", "1_clip=zclip"):
        tracker = make_tracker(cfg, run_dir=tmp_path / "sweep" / job)
        tracker.log_metrics({"loss": 1.0}, 0)
        tracker.finish()
    assert main(["replay", str(tmp_path / "sweep")]) == 0
    out = capsys.readouterr().out
    assert out.count("mlflow run ") == 2 and "0_clip=adagc:" in out and "1_clip=zclip:" in out


def test_replay_into_a_run_dir_that_takes_no_writes_opens_no_run(tmp_path, sqlite_uri, capsys, monkeypatch):
    """Held-out tester, stop 54: on a full disk each replay created an MLflow run, could not record it in the run
    dir, and left it RUNNING (two orphans before there was room), saying to wait for the store that had answered.
    Now replay checks the run dir takes writes before it opens a run. The fault: our file writer raising ENOSPC."""
    import errno

    from mlflow.tracking import MlflowClient

    from gradloc_track.trackers import replay as replay_mod
    from gradloc_track.trackers.run_record import update_run_record

    run = tmp_path / "run"
    spool = Spool(run / "spool" / "mlflow.jsonl", "mlflow")
    spool.write("log_metrics", [{"loss": 1.0}, 0], "down", ts=5)
    spool.write("finish", ["success"], "down", ts=6)
    update_run_record(run, "mlflow", spec={"tracking_uri": sqlite_uri, "experiment_name": "replayed", "run_name": None,
                                           "tags": {}})

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(replay_mod, "atomic_write_json", full)
        assert main(["replay", str(run)]) == 1
    err = capsys.readouterr().err
    assert "takes no writes (No space left on device)" in err and "once the store answers" not in err
    client = MlflowClient(sqlite_uri)
    assert client.get_experiment_by_name("replayed") is None or not client.search_runs(
        [client.get_experiment_by_name("replayed").experiment_id])
    # room again: one run, the records in it; the run dir lost other records while it ran (marked INCOMPLETE),
    # which the replayed run now says (the tester's run held steps 0-24 of 120 and nothing in MLflow said so)
    (run / "INCOMPLETE").write_text("spool/mlflow.jsonl: [Errno 28] No space left on device\n")
    assert main(["replay", str(run)]) == 0
    exp = client.get_experiment_by_name("replayed")
    (only,) = client.search_runs([exp.experiment_id])
    assert only.data.metrics["loss"] == 1.0 and only.info.status == "FINISHED"
    assert only.data.tags["gradloc_track.incomplete"] == "records lost; see INCOMPLETE"


def test_replaying_an_incomplete_run_dir_into_wandb_tags_it_before_its_end(tmp_path, monkeypatch, capsys):
    """Review, stop 54: the tag went to the run after its final status, and W&B refuses tags on a finished run:
    replay died with a traceback (UsageError). The tag goes before the final status, and is short (W&B: 64
    characters); a backend that refuses it is a warning. W&B offline, its own files."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    spool = Spool(run / "spool" / "wandb.jsonl", "wandb")
    for i in range(3):
        spool.write("log_metrics", [{"loss": float(i)}, i], "down", ts=5 + i)
    spool.write("finish", ["success"], "down", ts=9)
    from gradloc_track.trackers.run_record import update_run_record

    update_run_record(run, "wandb", spec={"project": "p", "mode": "offline", "dir": str(tmp_path)})
    (run / "INCOMPLETE").write_text("spool/wandb.jsonl: [Errno 28] No space left on device\n")
    assert main(["replay", str(run)]) == 0
    assert "replayed 4 record(s), final status success" in capsys.readouterr().out


def test_replay_into_a_deleted_or_purged_mlflow_run_is_refused_naming_the_fix(tmp_path, sqlite_uri, capsys):
    """Noticed at stop 54: the run deleted in the UI made replay a traceback ("must be in the 'active' state"),
    and a run gone from the store another. Now that backend is refused with the fix, the spool kept whole, and
    once the run is restored the same command sends everything."""
    import json

    from mlflow.tracking import MlflowClient

    from gradloc_track.trackers.run_record import update_run_record

    client = MlflowClient(sqlite_uri)
    exp = client.create_experiment("deleted")
    run_id = client.create_run(exp).info.run_id
    run = tmp_path / "run"
    spool = Spool(run / "spool" / "mlflow.jsonl", "mlflow")
    spool.write("log_metrics", [{"loss": 1.0}, 0], "down", ts=5)
    spool.write("finish", ["success"], "down", ts=6)
    update_run_record(run, "mlflow", spec={"tracking_uri": sqlite_uri, "experiment_name": "deleted", "run_name": None,
                                           "tags": {}}, run={"run_id": run_id, "experiment_id": exp})
    client.delete_run(run_id)
    assert main(["replay", str(run)]) == 2
    err = capsys.readouterr().err
    assert f"mlflow: not replayed: the MLflow run {run_id} in {sqlite_uri} is deleted" in err
    assert f"mlflow runs restore --run-id {run_id}" in err and "Traceback" not in err
    assert not (run / "spool" / "mlflow.replayed.json").exists() or \
        not json.loads((run / "spool" / "mlflow.replayed.json").read_text())["lines"]
    client.restore_run(run_id)
    assert main(["replay", str(run)]) == 0
    done = client.get_run(run_id)
    assert done.data.metrics["loss"] == 1.0 and done.info.status == "FINISHED"
    # a run the store no longer holds (purged, or another store): said so, with --tracking-uri
    update_run_record(run, "mlflow", run={"run_id": "0" * 32, "experiment_id": exp})
    spool.write("log_metrics", [{"loss": 2.0}, 1], "down", ts=7)
    assert main(["replay", str(run)]) == 2
    err = capsys.readouterr().err
    assert f"the MLflow run {'0' * 32} is not in {sqlite_uri}" in err and "--tracking-uri" in err


def test_a_replayed_w_and_b_run_of_a_tracker_both_pair_keeps_the_identity_it_shares(tmp_path, sqlite_uri,
                                                                                    monkeypatch):
    """Review, stop 64: ``replay`` resumed the W&B run without the identity it shares with its MLflow run, so the
    resumed folder's notes held its params only and ``culprits`` counted the pair twice. A real MLflow store, a real
    W&B offline run, the spool as the writer leaves it after an outage."""
    import time

    from gradloc_track.config import TrackerConfig
    from gradloc_track.trackers import make_tracker
    from gradloc_track.trackers.naming import RUN_FILE
    from gradloc_track.trackers.replay import replay_run_dir

    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-root"))
    cols = ["step", "level", "token", "share", "sample", "position", "end", "sample_id", "source"]
    row = [100, "sample", "junk", 0.9, 0, 0, 9, "a" * 16, "web"]
    cfg = TrackerConfig(kind="both")
    cfg.mlflow.tracking_uri = sqlite_uri
    run = tmp_path / "run"
    tracker = make_tracker(cfg, run_dir=run, run_name="r")
    tracker.log_table("spikes/tokens", cols, [row], 100)
    tracker.finish("success")
    spool = Spool(run / "spool" / "wandb.jsonl", "wandb")  # what W&B did not take
    spool.write("log_params", [{"spikes.enabled": True}], "outage")
    spool.write("log_table", ["spikes/tokens", cols, [row], 100], "outage")
    spool.write("finish", ["success"], "outage")
    time.sleep(1.1)  # (a resume within the same second gets a folder named <id>-1: read as well, see below)
    replay_run_dir(run, sqlite_uri)
    folders = sorted((tmp_path / "wandb-root" / "wandb").glob("offline-run-*"))
    assert len(folders) == 2
    notes = [json.loads((f / "files" / RUN_FILE).read_text()) for f in folders]
    assert notes[1]["same_run"] == notes[0]["same_run"] and notes[1]["params"] == {"spikes.enabled": True}
    mlflow_id = json.loads((run / "tracker" / "mlflow.json").read_text())["view"]["run_id"]
    out = tmp_path / "l"
    assert main(["culprits", mlflow_id, str(folders[1]), "--tracking-uri", sqlite_uri, "-o", str(out)]) == 0
    doc = json.loads((out / "culprits.json").read_text())
    assert (len(doc["runs"]), doc["samples"][0]["blamed"]) == (1, 1)


def test_a_w_and_b_folder_resumed_within_its_first_second_is_a_run_folder(tmp_path):
    from gradloc_track.trackers.backends.wandb import is_wandb_run, wandb_run_id

    for name, wid in (("offline-run-20261201_052811-ol81xr0j", "ol81xr0j"),
                      ("offline-run-20261201_052811-ol81xr0j-1", "ol81xr0j"), ("run-20261201_052811-ab12-2", "ab12")):
        (tmp_path / name / "files").mkdir(parents=True)
        assert is_wandb_run(tmp_path / name) and wandb_run_id(tmp_path / name) == wid
    (tmp_path / "offline-run-20261201_052811-x-y" / "files").mkdir(parents=True)
    assert not is_wandb_run(tmp_path / "offline-run-20261201_052811-x-y")


def test_a_replay_of_spikes_from_an_outage_keeps_the_runs_count_and_description_whole(tmp_path, sqlite_uri, capsys):
    """Held-out tester, stop 64: the spikes logged during an outage were replayed after the later ones had arrived;
    the run was left tagged with the replayed, older count (3 of 12), its ``spike_count`` metric read that too (every
    point was logged at step 0, the newest time winning), and the description told the replayed spikes only (the
    resumed run did not read the ones already there). A real MLflow store; the spool as the writer leaves it."""
    from mlflow.tracking import MlflowClient

    from gradloc_track.artifacts.events import EVENT_COLUMNS
    from gradloc_track.config import TrackerConfig
    from gradloc_track.trackers import make_tracker

    def spike(step: int, count: int) -> list[tuple[str, tuple]]:  # what the artifact writer sends for a spike
        row = [step, "grad_norm", 9.0, 1.0, 9.0, 30.0, "", "localized", "", "", "", "data", ""]
        return [("log_metrics", ({"spike_count": float(count)}, step)), ("set_tags", ({"spike_count": str(count)},)),
                ("log_table", ("spikes/events", EVENT_COLUMNS, [row], step))]

    cfg = TrackerConfig(kind="mlflow")
    cfg.mlflow.tracking_uri = sqlite_uri
    run = tmp_path / "run"
    tracker = make_tracker(cfg, run_dir=run, run_name="r")
    for step, count in ((20, 1), (80, 4), (100, 5)):  # before and after the outage
        for call, args in spike(step, count):
            getattr(tracker, call)(*args)
    tracker.finish("success")
    spool = Spool(run / "spool" / "mlflow.jsonl", "mlflow")
    for step, count in ((40, 2), (60, 3)):  # during it
        for call, args in spike(step, count):
            spool.write(call, list(args), "outage")
    assert main(["replay", str(run)]) == 0
    client = MlflowClient(sqlite_uri)
    got = client.get_run(json.loads((run / "tracker" / "mlflow.json").read_text())["view"]["run_id"])
    assert got.data.tags["spike_count"] == "5" and got.data.metrics["spike_count"] == 5.0
    assert sorted((m.step, m.value) for m in client.get_metric_history(got.info.run_id, "spike_count")) == [
        (0, 0.0), (20, 1.0), (40, 2.0), (60, 3.0), (80, 4.0), (100, 5.0)]
    assert "5 gradient spike(s) detected, at step 20, 40, 60, 80, 100" in got.data.tags["mlflow.note.content"]
