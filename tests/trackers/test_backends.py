"""The W&B and MLflow adapters against the real backends, read back from what they wrote."""
from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

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
    tracker.log_params({"lr": 0.001, "model": {"d": 32}.__repr__(), "long": "x" * 9000, "bad key!": 1})
    for step in range(5):
        tracker.log_metrics({"grad_norm/global": 1.0 + step, "grad_norm/h.0": 0.5 * step}, step)
    for e in range(events):
        tracker.log_table("spikes/tokens", ["step", "token", "grad_norm"], [[10 + e, f"t{e}", 1.5 * e],
                                                                           [10 + e, f"u{e}", 0.5]], 10 + e)
    tracker.log_html("spikes/highlight", HTML, 11)
    tracker.log_image("spikes/heatmap", png(tmp_path / "h.png"), 11)
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
    assert max(len(t["data"]) for t in cumulative) == 6  # all rows of all 3 events
    per_event = [json.loads(p.read_text()) for p in tables if "tokens_all" not in p.name]
    assert sorted(len(t["data"]) for t in per_event) == [2, 2, 2]
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
    assert run.data.tags["spike_count"] == "3"
    dl = Path(client.download_artifacts(run.info.run_id, "spikes", str(tmp_path / "dl")))
    table = json.loads((dl / "tokens.json").read_text())
    assert table["columns"] == ["step", "token", "grad_norm"] and len(table["data"]) == 6
    assert (dl / "highlight" / "step_000011.html").read_text() == HTML
    assert (dl / "heatmap" / "step_000011.png").read_bytes()[:4] == b"\x89PNG"


def test_mlflow_table_stays_one_file_after_100_events(tmp_path, sqlite_uri):
    from mlflow.tracking import MlflowClient

    cfg = TrackerConfig(kind="mlflow")
    cfg.mlflow.tracking_uri = sqlite_uri
    tracker = make_tracker(cfg, run_dir=tmp_path / "run")
    for e in range(100):
        tracker.log_table("spikes/tokens", ["step", "token"], [[e, f"tok{e}"]], e)
    tracker.finish("success")
    client = MlflowClient(sqlite_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("gradloc-track").experiment_id])
    logged = json.loads(run.data.tags["mlflow.loggedArtifacts"])
    assert logged == [{"path": "spikes/tokens.json", "type": "table"}]
    dl = client.download_artifacts(run.info.run_id, "spikes/tokens.json", str(tmp_path / "dl"))
    data = json.loads(Path(dl).read_text())["data"]
    assert [r[0] for r in data] == list(range(100))


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
        ["spikes/heatmap", "spikes/highlight", "spikes/tokens.json"]
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


def test_wandb_cumulative_table_after_100_events(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    tracker = make_tracker(TrackerConfig(kind="wandb"), run_dir=tmp_path / "run")
    for e in range(100):
        tracker.log_table("spikes/tokens", ["step", "token"], [[e, f"tok{e}"]], e)
    tracker.finish("success")
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    tables = [json.loads(p.read_text()) for p in (run_dir / "files" / "media" / "table").rglob("*.table.json")]
    cumulative = max((t for t in tables if len(t["data"]) > 1), key=lambda t: len(t["data"]))
    assert [r[0] for r in cumulative["data"]] == list(range(100))  # every event, in order, once
    rows = [r for r in history(run_dir) if "spikes/tokens_all/nrows" in r]
    assert [(r["train/step"], r["spikes/tokens_all/nrows"]) for r in rows] == [(e, e + 1) for e in range(100)]
