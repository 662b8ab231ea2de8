"""Smoke runs of examples/train_lm.py as a user runs it: a subprocess with Hydra overrides."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gradloc_track.artifacts import read_table

from ..conftest import ROOT

SCRIPT = ROOT / "examples" / "train_lm.py"
SMALL = ["train.steps=4", "train.batch_size=2", "train.seq_len=32", "model.n_layer=1", "model.d_model=32",
         "model.n_head=2", "model.max_seq_len=32", "train.num_threads=1"]


def run_example(tmp_path: Path, *overrides: str, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true",
           "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'mlflow.db'}"}
    flags = [o for o in overrides if o.startswith("-")]  # Hydra wants -m before the overrides
    rest = [o for o in overrides if not o.startswith("-")]
    proc = subprocess.run([sys.executable, str(SCRIPT), *flags, f"out_dir={tmp_path / 'runs'}", *rest],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"train_lm failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def run_dirs(tmp_path: Path) -> list[Path]:
    return sorted(p.parent for p in (tmp_path / "runs").rglob("summary.json"))


def mlflow_runs(tmp_path: Path):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.get_experiment_by_name("gradloc-track")
    return client, client.search_runs([exp.experiment_id])


def test_none_tracker_writes_local_files(tmp_path):
    run_example(tmp_path, "tracker=none", *SMALL)
    (run_dir,) = run_dirs(tmp_path)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(line)["step"] for line in lines]
    assert set(range(4)) <= set(steps)
    assert "grad_norm/global" in json.loads(lines[0])["metrics"]
    assert (run_dir / "config.yaml").exists()


def test_mlflow_tracker_logs_metrics_params_and_config(tmp_path):
    run_example(tmp_path, "tracker=mlflow", *SMALL)
    client, runs = mlflow_runs(tmp_path)
    (run,) = runs
    assert run.info.status == "FINISHED"
    hist = client.get_metric_history(run.info.run_id, "grad_norm/global")
    assert sorted(m.step for m in hist) == [0, 1, 2, 3]
    assert run.data.params["train.steps"] == "4" and run.data.params["clip.kind"] == "none"
    names = [a.path for a in client.list_artifacts(run.info.run_id)]
    assert any(n.endswith("config.yaml") for n in names)


def test_wandb_and_both_trackers_run_offline(tmp_path):
    run_example(tmp_path, "tracker=both", "tracker.mlflow.tracking_uri=sqlite:///" + str(tmp_path / "b.db"), *SMALL)
    assert list(tmp_path.rglob("offline-run-*")), "no offline W&B run directory was written"
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'b.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("gradloc-track").experiment_id])
    assert run.data.metrics["grad_norm/global"] > 0


def test_bad_override_fails_with_a_clear_message(tmp_path):
    proc = run_example(tmp_path, "monitor.log_every=-1", *SMALL, check=False)
    assert proc.returncode != 0
    assert "monitor.log_every" in proc.stderr and "positive integer" in proc.stderr


def test_multirun_gives_one_tracker_run_per_job(tmp_path):
    run_example(tmp_path, "-m", "tracker=mlflow", "clip=none,adagc", *SMALL)
    _, runs = mlflow_runs(tmp_path)
    assert len(runs) == 2
    names = sorted(r.info.run_name for r in runs)
    assert any("clip=adagc" in n for n in names) and any("clip=none" in n for n in names)
    assert {r.data.params["clip.kind"] for r in runs} == {"none", "adagc"}


@pytest.mark.slow
def test_spike_demo_detects_and_localizes_the_injected_document(tmp_path):
    """The full demo: detection at the injected step, culprits = the corrupted tokens, artifacts in MLflow."""
    run_example(tmp_path, "experiment=spike_demo", "tracker=both", "train.num_threads=1",
                f"tracker.mlflow.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}")
    (run_dir,) = run_dirs(tmp_path)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert 100 in summary["events_at"]
    client, (run,) = mlflow_runs(tmp_path)
    assert int(run.data.tags["spike_count"]) >= 1
    local = Path(client.download_artifacts(run.info.run_id, "spikes", str(tmp_path / "dl")))
    table = read_table(local.parent, "spikes/tokens")
    cols = table["columns"]
    rows = [dict(zip(cols, r)) for r in table["data"] if dict(zip(cols, r))["step"] == 100]
    assert {(r["sample"], r["position"]) for r in rows} == {(3, 0), (3, 1)}
    html = (local / "highlight" / "step_000100.html").read_text()
    for r in rows:
        assert r["token"] in html or r["token"].replace("\\", "&#92;") in html
    assert "<script" not in html.lower()
    # the same event in the offline W&B run: table rows and highlighted html
    (wrun,) = tmp_path.rglob("offline-run-*")
    tables = [json.loads(p.read_text()) for p in (wrun / "files" / "media" / "table").rglob("*.table.json")]
    assert any({(r[1], r[2]) for r in t["data"] if r[0] == 100} == {(3, 0), (3, 1)} for t in tables)
    pages = [p.read_text() for p in (wrun / "files" / "media" / "html").rglob("*.html")]
    assert any(rows[0]["token"] in p for p in pages)
