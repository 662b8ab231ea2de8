"""Which tracker runs a run directory belongs to, as the report and the console read it.

The app prints one run directory; the run itself may live in MLflow (a store or a server) or in
W&B's offline files. Each backend adapter records where its run is as soon as it exists, as the
``view`` of the run directory's tracker record ``<run dir>/tracker/<backend>.json`` -- the same
record ``gradloc-track replay`` reads (``trackers/run_record.py``: one record per backend run,
written atomically). So ``gradloc-track report <run dir>`` and the console follow the directory
to the run:

    {"mlflow": {"tracking_uri": ..., "experiment_id": ..., "run_id": ..., "run_name": ...},
     "wandb": {"dir": <the offline-run-* / run-* folder>, "path": "entity/project/run_id", ...}}

Never raises: a run without a record still trains.
"""
from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any


def record_run(run_dir: str | Path | None, backend: str, info: dict[str, Any]) -> None:
    """Record where ``backend``'s run is (no-op without a run dir)."""
    if run_dir is None:
        return
    from .trackers.run_record import record_path, update_run_record

    if not update_run_record(run_dir, backend, view={k: v for k, v in info.items() if v is not None}):
        warnings.warn(f"gradloc-track: could not record the {backend} run in {record_path(run_dir, backend)}")


def read_run_record(run_dir: str | Path) -> dict[str, Any]:
    """``{backend: view}`` for every backend run of ``run_dir``; ``{}`` when there is none."""
    folder = Path(run_dir) / "tracker"
    out: dict[str, Any] = {}
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            rec = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(rec, dict) and isinstance(rec.get("view"), dict):
            out[path.stem] = rec["view"]
    return out


def mlflow_ui_base(tracking_uri: str) -> str:
    """The address the run opens at: the server itself, else where ``mlflow ui`` serves a store."""
    if tracking_uri.startswith(("http://", "https://")):
        return tracking_uri.rstrip("/")
    return "http://127.0.0.1:5000"


# MLflow 3's UI shows the GenAI side (traces) unless told otherwise: it reads the view from this
# query parameter of the (hash) route, else from the browser's last choice (mlflow/server/js)
MODEL_TRAINING_VIEW = "workflowType=machine_learning"


def mlflow_run_url(info: dict[str, Any], page: str = "") -> str | None:
    """``<ui>/#/experiments/<id>/runs/<run id>[/<page>]?workflowType=machine_learning``.

    The run's own page in the UI's "Model training" view, without a switch by hand.
    """
    if not info.get("run_id") or not info.get("experiment_id"):
        return None
    base = mlflow_ui_base(str(info.get("tracking_uri", "")))
    tail = f"/{page.strip('/')}" if page else ""
    return f"{base}/#/experiments/{info['experiment_id']}/runs/{info['run_id']}{tail}?{MODEL_TRAINING_VIEW}"


def mlflow_ui_command(tracking_uri: str) -> str | None:
    """The command that serves a local store (None for a server, which is already up)."""
    if tracking_uri.startswith(("http://", "https://")):
        return None
    return f"mlflow ui --backend-store-uri {tracking_uri} --port 5000"
