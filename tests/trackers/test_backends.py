"""The W&B and MLflow adapters against the real backends, read back from what they wrote."""
from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from gradloc_track.artifacts import read_table
from gradloc_track.config import TrackerConfig
from gradloc_track.trackers import make_tracker

from ..wandb_reader import history, summary

HTML = "<html><body><p style='color:red'>&lt;b&gt; culprit</p></body></html>"


def png(path: Path) -> Path:
    """A 1x1 PNG written by hand (no imaging dependency)."""
    import zlib

    def chunk(tag, data):
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

    raw = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 1, 1, 8, 2, 0, 0, 0)) + \
        chunk(b"IDAT", zlib.compress(b"\x00\xff\x00\x00")) + chunk(b"IEND", b"")
    path.write_bytes(raw)
    return path


def exercise(tracker, tmp_path, events=3):
    tracker.log_params({"lr": 0.001, "model": {"d": 32}.__repr__(), "long": "x" * 9000, "bad key!": 1,
                        "unset": None})
    for step in range(5):
        tracker.log_metrics({"grad_norm/global": 1.0 + step, "grad_norm/h.0": 0.5 * step}, step)
    for e in range(events):
        tracker.log_table("spikes/tokens", ["step", "token", "grad_norm"], [[10 + e, f"t{e}", 1.5 * e],
                                                                           [10 + e, f"u{e}", 0.5]], 10 + e)
    tracker.log_html("spikes/highlight", HTML, 9 + events)
    tracker.log_image("spikes/heatmap", png(tmp_path / "h.png"), 9 + events)
    tracker.set_tags({"spike_count": "3"})
    tracker.finish("success")


def test_wandb_offline_run_files_read_back(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    tracker = make_tracker(TrackerConfig(kind="wandb"), run_dir=tmp_path / "run", run_name="t")
    exercise(tracker, tmp_path)
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    rows = history(run_dir)
    norms = {(r["train/step"], r["grad_norm/global"]) for r in rows if "grad_norm/global" in r}
    assert norms == {(s, 1.0 + s) for s in range(5)}
    tables = sorted((run_dir / "files" / "media" / "table").rglob("*.table.json"))
    cumulative = [json.loads(p.read_text()) for p in tables if "tokens_all" in p.name]
    assert [len(t["data"]) for t in cumulative] == [6]  # all rows of all 3 events, logged once
    per_event = [json.loads(p.read_text()) for p in tables if "tokens_all" not in p.name]
    assert sorted(len(t["data"]) for t in per_event) == [2, 2, 2]
    # media sit at the training step: W&B's own step (the media slider) is ours
    media = [r for r in rows if any(k.split("/_")[0].rsplit("/", 1)[0] in ("spikes/highlight", "spikes/heatmap",
                                                                          "spikes/tokens") for k in r)]
    assert media and all(r["_step"] == r["train/step"] for r in media), media
    assert {r["train/step"] for r in media} == {10, 11, 12}
    (html,) = list((run_dir / "files" / "media" / "html").rglob("*.html"))
    text = html.read_text()
    assert "culprit" in text and "<link" not in text and "stylesheet" not in text
    assert list((run_dir / "files" / "media" / "images").rglob("*.png"))
    assert summary(run_dir)["spike_count"] == "3"


def test_mlflow_sqlite_store_read_back(tmp_path, sqlite_uri):
    from mlflow.tracking import MlflowClient

    cfg = TrackerConfig(kind="mlflow")
    cfg.mlflow.tracking_uri = sqlite_uri
    tracker = make_tracker(cfg, run_dir=tmp_path / "run", run_name="mlflow-test")
    exercise(tracker, tmp_path)
    client = MlflowClient(sqlite_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("gradloc-track").experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == "mlflow-test"
    hist = client.get_metric_history(run.info.run_id, "grad_norm/global")
    assert sorted((m.step, m.value) for m in hist) == [(s, 1.0 + s) for s in range(5)]
    params = run.data.params
    assert params["lr"] == "0.001" and params["bad key_"] == "1"
    assert len(params["long"]) <= 6000 and params["long"].endswith("[truncated]")
    assert "unset" not in params and "None" not in params.values()
    tags = run.data.tags
    assert tags["spike_count"] == "3" and run.data.metrics["spike_count"] == 3.0  # sortable in the runs table
    assert tags["mlflow.source.name"] and tags["mlflow.user"] and "spikes/" in tags["mlflow.note.content"]
    dl = Path(client.download_artifacts(run.info.run_id, "spikes", str(tmp_path / "dl")))
    table = read_table(dl.parent, "spikes/tokens")
    assert table["columns"] == ["step", "token", "grad_norm"] and len(table["data"]) == 6
    assert sorted(p.name for p in (dl / "tokens").iterdir()) == [f"step_0000{10 + e}.json" for e in range(3)]
    assert (dl / "highlight" / "step_000012.html").read_text() == HTML
    assert (dl / "heatmap" / "step_000012.png").read_bytes()[:4] == b"\x89PNG"


def test_mlflow_table_is_appended_never_downloaded(tmp_path, sqlite_uri, capfd):
    from mlflow.tracking import MlflowClient

    cfg = TrackerConfig(kind="mlflow")
    cfg.mlflow.tracking_uri = sqlite_uri
    tracker = make_tracker(cfg, run_dir=tmp_path / "run")
    for e in range(100):
        tracker.log_table("spikes/tokens", ["step", "token"], [[e, f"tok{e}"]], e)
    tracker.log_table("spikes/tokens", ["step", "token"], [[99, "again"]], 99)  # same event: same part
    tracker.finish("success")
    out = capfd.readouterr()
    assert "Downloading artifacts" not in out.err + out.out, "no download (and no progress bar) per event"
    client = MlflowClient(sqlite_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("gradloc-track").experiment_id])
    assert "mlflow.loggedArtifacts" not in run.data.tags  # MlflowClient.log_table (download+rewrite) unused
    parts = client.list_artifacts(run.info.run_id, "spikes/tokens")
    assert len(parts) == 100 and max(p.file_size for p in parts) < 200  # one small part per event
    dl = client.download_artifacts(run.info.run_id, "spikes", str(tmp_path / "dl"))
    data = read_table(Path(dl).parent, "spikes/tokens")["data"]
    assert data == [[e, f"tok{e}"] for e in range(100)] + [[99, "again"]]


def test_mlflow_through_a_real_server(tmp_path, mlflow_server):
    from mlflow.tracking import MlflowClient

    cfg = TrackerConfig(kind="mlflow")
    cfg.mlflow.tracking_uri = mlflow_server
    cfg.mlflow.experiment_name = "server-test"
    tracker = make_tracker(cfg, run_dir=tmp_path / "run")
    exercise(tracker, tmp_path, events=1)
    client = MlflowClient(mlflow_server)
    (run,) = client.search_runs([client.get_experiment_by_name("server-test").experiment_id])
    assert len(client.get_metric_history(run.info.run_id, "grad_norm/h.0")) == 5
    assert [a.path for a in client.list_artifacts(run.info.run_id, "spikes")] == \
        ["spikes/heatmap", "spikes/highlight", "spikes/tokens"]
    assert not (tmp_path / "run" / "spool").exists()


def test_failed_run_is_marked_failed(tmp_path, sqlite_uri):
    from mlflow.tracking import MlflowClient

    cfg = TrackerConfig(kind="mlflow")
    cfg.mlflow.tracking_uri = sqlite_uri
    with pytest.raises(ZeroDivisionError):
        with make_tracker(cfg, run_dir=tmp_path / "run") as tracker:
            tracker.log_metrics({"a": 1.0}, 0)
            1 / 0
    client = MlflowClient(sqlite_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("gradloc-track").experiment_id])
    assert run.info.status == "FAILED"


def test_wandb_table_grows_linearly_over_100_events(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    tracker = make_tracker(TrackerConfig(kind="wandb"), run_dir=tmp_path / "run")
    for e in range(100):
        tracker.log_table("spikes/tokens", ["step", "token"], [[e, f"tok{e}"]], e)
    tracker.finish("success")
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    files = list((run_dir / "files" / "media" / "table").rglob("*.table.json"))
    tables = {p: json.loads(p.read_text()) for p in files}
    (cumulative,) = [t for p, t in tables.items() if "tokens_all" in p.name]  # logged once, at finish
    assert [r[0] for r in cumulative["data"]] == list(range(100))  # every event, in order, once
    assert sorted(len(t["data"]) for p, t in tables.items() if "tokens_all" not in p.name) == [1] * 100
    total = sum(p.stat().st_size for p in files)
    assert total < 3 * 2 * cumulative_size(cumulative), "table bytes must grow linearly with the events"
    rows = [r for r in history(run_dir) if "spikes/tokens/nrows" in r]
    assert [(r["_step"], r["train/step"]) for r in rows] == [(e, e) for e in range(100)]


def cumulative_size(table) -> int:
    return len(json.dumps(table))


def test_wandb_config_file_keeps_its_own_name(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    tracker = make_tracker(TrackerConfig(kind="wandb"), run_dir=tmp_path / "run")
    cfg = tmp_path / "config.yaml"
    cfg.write_text("model:\n  n_layer: 2\n")
    tracker.log_artifact(cfg)
    tracker.log_params({"model.n_layer": 2})
    tracker.finish("success")
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    ours = run_dir / "files" / "gradloc-config.yaml"
    assert ours.read_text() == "model:\n  n_layer: 2\n"
    reserved = run_dir / "files" / "config.yaml"  # W&B's own run config, not overwritten by ours
    assert not reserved.exists() or "n_layer: 2\n" not in reserved.read_text().replace("value: 2", "")
