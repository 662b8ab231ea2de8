"""``trackers/mlflow_links``: the UI addresses of a run and of its experiment's charts, and the
command that serves a local store, each checked against the address written out by hand."""
from __future__ import annotations

import shlex

import pytest

from gradloc_track.trackers.mlflow_links import (MODEL_TRAINING_VIEW, mlflow_charts_url, mlflow_run_url,
                                                 mlflow_ui_base, mlflow_ui_command)

RUN = {"tracking_uri": "sqlite:////data/mlflow.db", "experiment_id": "3", "run_id": "abc", "run_name": "demo"}


@pytest.mark.parametrize("uri,base", [
    ("http://10.0.0.2:5000", "http://10.0.0.2:5000"),
    ("https://mlflow.example.org/", "https://mlflow.example.org"),  # no double slash before '#'
    ("sqlite:////data/mlflow.db", "http://127.0.0.1:5000"),  # a local store: where `mlflow ui` serves it
    ("file:///tmp/mlruns", "http://127.0.0.1:5000"),
    ("", "http://127.0.0.1:5000"),
])
def test_the_ui_base_is_the_server_else_the_local_ui(uri, base):
    assert mlflow_ui_base(uri) == base


def test_the_run_url_opens_the_runs_page_in_the_model_training_view():
    assert MODEL_TRAINING_VIEW == "workflowType=machine_learning"
    assert mlflow_run_url(RUN) == "http://127.0.0.1:5000/#/experiments/3/runs/abc?workflowType=machine_learning"
    for page in ("artifacts/spikes/x.html", "/artifacts/spikes/x.html/"):
        assert mlflow_run_url({**RUN, "tracking_uri": "http://h:1"}, page) == \
            "http://h:1/#/experiments/3/runs/abc/artifacts/spikes/x.html?workflowType=machine_learning"


@pytest.mark.parametrize("missing", ["run_id", "experiment_id"])
def test_no_run_url_without_the_ids(missing):
    assert mlflow_run_url({**RUN, missing: None}) is None
    assert mlflow_run_url({k: v for k, v in RUN.items() if k != missing}) is None


def test_the_charts_url_overlays_every_run_of_the_experiment():
    assert mlflow_charts_url(RUN) == \
        "http://127.0.0.1:5000/#/experiments/3/runs?compareRunsMode=CHART&workflowType=machine_learning"
    assert mlflow_charts_url({"run_id": "abc"}) is None
    assert mlflow_charts_url({"experiment_id": "0"}) == \
        "http://127.0.0.1:5000/#/experiments/0/runs?compareRunsMode=CHART&workflowType=machine_learning"


def test_the_ui_command_serves_a_local_store_and_nothing_for_a_server():
    assert mlflow_ui_command("sqlite:////data/mlflow.db") == \
        "mlflow ui --backend-store-uri sqlite:////data/mlflow.db --port 5000"
    assert mlflow_ui_command("http://h:5000") is None and mlflow_ui_command("https://h") is None


def test_the_ui_command_can_be_pasted_into_a_shell_whatever_the_path():
    """A store under a folder with a space (or a quote) is one argument to the shell."""
    for uri in ("sqlite:////home/me/My Runs/mlflow.db", "sqlite:////tmp/it's/mlflow.db"):
        argv = shlex.split(mlflow_ui_command(uri))
        assert argv == ["mlflow", "ui", "--backend-store-uri", uri, "--port", "5000"]
