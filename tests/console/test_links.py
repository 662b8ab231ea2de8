"""``console/links``: where to look at a run (its MLflow / W&B runs, its local files) and the commands
that open them, read from the run record; each line checked against the address written out."""
from __future__ import annotations

from gradloc_track.console.links import event_page, highlight_page, spike_link, view_commands, where_to_look
from gradloc_track.trackers.join import RunDir
from gradloc_track.trackers.run_record import record_run

from .cases import mlflow_record

RUN_ID = "a" * 32
RUN_URL = f"http://127.0.0.1:5000/#/experiments/3/runs/{RUN_ID}"
VIEW = "?workflowType=machine_learning"


def test_the_pages_of_a_spike():
    assert highlight_page(7) == "spikes/highlight/step_000007.html"
    assert event_page(123456) == "spikes/events/step_123456.csv"


def test_where_to_look_names_each_backend_run_then_the_local_files(tmp_path):
    mlflow_record(tmp_path, RUN_ID)
    record_run(tmp_path, "wandb", {"path": "me/proj/xyz", "url": "https://wandb.ai/me/proj/runs/xyz"})
    (tmp_path / "spikes").mkdir()
    assert where_to_look(tmp_path, 100) == [
        f"MLflow run spike_demo ({RUN_ID}): {RUN_URL}/artifacts/spikes/highlight/step_000100.html{VIEW}",
        "W&B run me/proj/xyz: https://wandb.ai/me/proj/runs/xyz",
        f"local files: {tmp_path / 'spikes'}"]
    assert where_to_look(tmp_path, 100, page=event_page(100))[0].endswith(
        f"/artifacts/spikes/events/step_000100.csv{VIEW}")
    assert where_to_look(tmp_path)[0] == f"MLflow run spike_demo ({RUN_ID}): {RUN_URL}{VIEW}"  # no step: the run


def test_an_offline_wandb_run_is_named_by_its_folder(tmp_path):
    record_run(tmp_path, "wandb", {"dir": "/w/offline-run-1", "path": "me/proj/xyz", "offline": True})
    assert where_to_look(tmp_path) == ["W&B run me/proj/xyz (offline: /w/offline-run-1)"]


def test_local_files_are_the_spikes_folder_else_the_rendered_one_else_the_run_dir(tmp_path):
    """(the last case moved here from tests/console/test_block.py)"""
    assert where_to_look(tmp_path / "nothing") == [f"run dir: {tmp_path / 'nothing'} (the spike's files are on their "
                                                   "way; a tracker run's link is printed once it opens)"]
    (tmp_path / "rendered").mkdir()
    assert where_to_look(tmp_path) == [f"local files: {tmp_path / 'rendered'}"]
    (tmp_path / "spikes").mkdir()
    assert where_to_look(tmp_path) == [f"local files: {tmp_path / 'spikes'}"]


def test_a_scratch_dir_is_never_shown_as_a_place_to_look(temp_root):
    scratch = RunDir()
    try:
        (scratch.path / "spikes").mkdir()
        assert where_to_look(scratch.path, 3) == ["no run dir: pass run_dir= to keep this run's files"]
        mlflow_record(scratch.path, RUN_ID)
        shown = where_to_look(scratch.path, 3)
        assert len(shown) == 1 and shown[0].startswith("MLflow run spike_demo") and str(scratch.path) not in shown[0]
    finally:
        scratch.remove()


def test_an_mlflow_view_without_its_ids_gives_no_broken_link(tmp_path):
    """A record whose run has no id yet: no "None" shown as an address, no ``None`` line to open."""
    record_run(tmp_path, "mlflow", {"tracking_uri": "sqlite:////data/mlflow.db", "run_name": "early"})
    shown = where_to_look(tmp_path, 5)
    assert not any("None" in line for line in shown) and shown[0].startswith(f"run dir: {tmp_path} (")
    assert not any("None" in line for line in view_commands(tmp_path))
    assert spike_link(tmp_path, 5, localized=True) is None
    record_run(tmp_path, "mlflow", {"run_id": "r", "experiment_id": "1"})  # no store named: no command to serve it
    assert not any("mlflow ui" in c for c in view_commands(tmp_path))


def test_spike_link_is_the_highlight_when_localized_else_the_events_row(tmp_path):
    assert spike_link(tmp_path, 9, localized=True) is None  # no MLflow run: no link
    mlflow_record(tmp_path, RUN_ID)
    assert spike_link(tmp_path, 9, localized=True) == f"{RUN_URL}/artifacts/spikes/highlight/step_000009.html{VIEW}"
    assert spike_link(tmp_path, 9, localized=False) == f"{RUN_URL}/artifacts/spikes/events/step_000009.csv{VIEW}"


def test_view_commands_serve_the_store_open_the_run_and_sync_an_offline_wandb_run(tmp_path):
    """(moved here from tests/console/test_block.py, with every line checked)"""
    assert view_commands(tmp_path) == [f"  gradloc-track report {tmp_path} -o spike_report.html    "
                                       "# one HTML page, no server needed"]
    mlflow_record(tmp_path, RUN_ID)
    record_run(tmp_path, "wandb", {"dir": "/w/offline-run-1", "path": "me/proj/xyz", "offline": True})
    cmds = view_commands(tmp_path)
    assert cmds[0] == "  mlflow ui --backend-store-uri sqlite:////data/mlflow.db --port 5000    " \
                      "# the UI takes ~30-60 s to start; then open"
    assert cmds[1] == f"  {RUN_URL}{VIEW}"
    assert cmds[2].startswith("  http://127.0.0.1:5000/#/experiments/3/runs?compareRunsMode=CHART")
    assert cmds[3] == "  wandb sync /w/offline-run-1    # upload the offline W&B run"
    assert cmds[4].startswith(f"  gradloc-track report {tmp_path} -o spike_report.html")
    record_run(tmp_path, "mlflow", {"tracking_uri": "http://10.0.0.2:5000"})  # a server: nothing to serve
    assert not any("mlflow ui" in c for c in view_commands(tmp_path))
