"""MLflow adapter: an explicit run id through ``MlflowClient`` (never the global active run).

Tracking URI: config, else MLflow's own ``MLFLOW_TRACKING_URI``, else ``sqlite:///./mlflow.db``
(MLflow 3 refuses plain folder stores). Key cleaning, param truncation and batching live here.
"""
from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any, Mapping

from .._optional import require
from .base import Tracker
from .keys import mlflow_key, step_path, truncate

MAX_METRICS_PER_BATCH = 1000  # MLflow's log_batch limit
MAX_PARAMS_PER_BATCH = 100
MAX_PARAM_VALUE = 6000  # MLflow 3 param value length limit
MAX_TAG_VALUE = 5000


def resolve_tracking_uri(configured: str | None) -> str:
    """Config wins; then MLflow's own env var; then an SQLite store in the working directory."""
    if configured:
        return configured
    env = os.environ.get("MLFLOW_TRACKING_URI")
    if env:
        return env
    return f"sqlite:///{Path.cwd() / 'mlflow.db'}"


class MlflowTracker(Tracker):
    name = "mlflow"

    def __init__(self, tracking_uri: str | None = None, experiment_name: str = "gradloc-track",
                 run_name: str | None = None, tags: Mapping[str, str] | None = None,
                 run_dir: str | Path | None = None, run_id: str | None = None) -> None:
        """``run_id`` attaches to a run someone else opened (HF Trainer, Lightning, the user): log
        into it and leave it open at ``finish()``; without it a new run is created and owned."""
        require("mlflow", "mlflow")
        from mlflow.tracking import MlflowClient

        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.tracking_uri = resolve_tracking_uri(tracking_uri)
        self.client = MlflowClient(tracking_uri=self.tracking_uri)
        self.attached = run_id is not None
        if self.attached:
            self.run_id = run_id
            self.experiment_id = self.client.get_run(run_id).info.experiment_id
            return
        exp = self.client.get_experiment_by_name(experiment_name)
        if exp is None:
            try:
                exp_id = self.client.create_experiment(experiment_name)
            except Exception:  # created concurrently by a sibling multirun job
                exp_id = self.client.get_experiment_by_name(experiment_name).experiment_id
        else:
            exp_id = exp.experiment_id
        run = self.client.create_run(exp_id, run_name=run_name, tags=dict(tags or {}))
        self.run_id = run.info.run_id
        self.experiment_id = exp_id

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        items = [Metric(mlflow_key(k), float(v), ts, int(step)) for k, v in metrics.items()]
        for i in range(0, len(items), MAX_METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=items[i: i + MAX_METRICS_PER_BATCH], synchronous=True)

    def log_params(self, params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(mlflow_key(k), truncate(v, MAX_PARAM_VALUE)) for k, v in params.items()]
        for i in range(0, len(items), MAX_PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=items[i: i + MAX_PARAMS_PER_BATCH], synchronous=True)

    def log_table(self, key, columns, rows, step=None) -> None:
        # one growing file per key: MlflowClient.log_table appends to an existing artifact and
        # records its path once in the run's mlflow.loggedArtifacts tag
        data = {c: [r[i] for r in rows] for i, c in enumerate(columns)}
        self.client.log_table(self.run_id, data=data, artifact_file=f"{key}.json")

    def log_html(self, key, html, step=None) -> None:
        self.client.log_text(self.run_id, html, step_path(key, step, "html"))

    def log_image(self, key, path, step=None) -> None:
        rel = step_path(key, step, "png")
        with tempfile.TemporaryDirectory() as tmp:
            dst = Path(tmp) / Path(rel).name
            dst.write_bytes(Path(path).read_bytes())
            self.client.log_artifact(self.run_id, str(dst), artifact_path=str(Path(rel).parent))

    def log_artifact(self, path, artifact_path=None) -> None:
        self.client.log_artifact(self.run_id, str(path), artifact_path=artifact_path)

    def set_tags(self, tags: Mapping[str, str]) -> None:
        from mlflow.entities import RunTag

        items = [RunTag(mlflow_key(k), truncate(v, MAX_TAG_VALUE)) for k, v in tags.items()]
        self.client.log_batch(self.run_id, tags=items, synchronous=True)

    def finish(self, status: str = "success") -> None:
        if self.attached:  # never end a run we did not open
            return
        self.client.set_terminated(self.run_id, "FINISHED" if status == "success" else "FAILED")
