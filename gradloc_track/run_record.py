"""Which tracker runs a run directory belongs to: ``<run dir>/gradloc_run.json``.

The app prints one run directory; the run itself may live in MLflow (a store or a server) or in
W&B's offline files. Each backend adapter records where its run is as soon as it exists, so
``gradloc-track report <run dir>`` and the console can follow the directory to the run:

    {"mlflow": {"tracking_uri": ..., "experiment_id": ..., "run_id": ..., "run_name": ...},
     "wandb": {"dir": <the offline-run-* / run-* folder>, "path": "entity/project/run_id", ...}}

Writes are atomic (temp file + rename) and merge per backend, so ``tracker=both`` keeps both.
Never raises: a run without a record still trains.
"""
from __future__ import annotations

import json
import os
import threading
import warnings
from pathlib import Path
from typing import Any

RECORD_NAME = "gradloc_run.json"
_lock = threading.Lock()


def record_run(run_dir: str | Path | None, backend: str, info: dict[str, Any]) -> None:
    """Merge ``{backend: info}`` into the run directory's record (no-op without a run dir)."""
    if run_dir is None:
        return
    path = Path(run_dir) / RECORD_NAME
    try:
        with _lock:
            record = read_run_record(run_dir)
            record[backend] = {k: v for k, v in info.items() if v is not None}
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{RECORD_NAME}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(record, indent=2, default=str), encoding="utf-8")
            os.replace(tmp, path)
    except OSError as exc:
        warnings.warn(f"gradloc-track: could not record the {backend} run in {path}: {exc}")


def read_run_record(run_dir: str | Path) -> dict[str, Any]:
    """The record, or ``{}`` when there is none or it cannot be read."""
    try:
        data = json.loads((Path(run_dir) / RECORD_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


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
