"""Links into MLflow's UI for a run (printed by the console, put on the report page).

Pure string work from a run's ``view`` (``run_record``): nothing here imports mlflow.
"""
from __future__ import annotations

import shlex
from typing import Any

# MLflow 3's UI shows the GenAI side (traces) unless told otherwise: it reads the view from this
# query parameter of the (hash) route, else from the browser's last choice (mlflow/server/js)
MODEL_TRAINING_VIEW = "workflowType=machine_learning"


def mlflow_ui_base(tracking_uri: str) -> str:
    """The address the run opens at: the server itself, else where ``mlflow ui`` serves a store."""
    if tracking_uri.startswith(("http://", "https://")):
        return tracking_uri.rstrip("/")
    return "http://127.0.0.1:5000"


def mlflow_run_url(info: dict[str, Any], page: str = "") -> str | None:
    """``<ui>/#/experiments/<id>/runs/<run id>[/<page>]?workflowType=machine_learning``.

    The run's own page in the UI's "Model training" view, without a switch by hand.
    """
    if not info.get("run_id") or not info.get("experiment_id"):
        return None
    base = mlflow_ui_base(str(info.get("tracking_uri", "")))
    tail = f"/{page.strip('/')}" if page else ""
    return f"{base}/#/experiments/{info['experiment_id']}/runs/{info['run_id']}{tail}?{MODEL_TRAINING_VIEW}"


def mlflow_charts_url(info: dict[str, Any]) -> str | None:
    """The experiment's runs as charts (``compareRunsMode=CHART``): one chart per metric with every
    run overlaid, the view for comparing runs (MLflow's compare-runs page opens on a
    parallel-coordinates plot of params instead)."""
    if not info.get("experiment_id"):
        return None
    base = mlflow_ui_base(str(info.get("tracking_uri", "")))
    return f"{base}/#/experiments/{info['experiment_id']}/runs?compareRunsMode=CHART&{MODEL_TRAINING_VIEW}"


def mlflow_ui_command(tracking_uri: str) -> str | None:
    """The command that serves a local store (None for a server, which is already up), quoted for a
    shell where the store's path needs it."""
    if tracking_uri.startswith(("http://", "https://")):
        return None
    return f"mlflow ui --backend-store-uri {shlex.quote(tracking_uri)} --port 5000"
