"""Where to look at a run: its MLflow / W&B links and local files, and the commands that open them."""
from __future__ import annotations

from pathlib import Path

from ..trackers.mlflow_links import mlflow_charts_url, mlflow_run_url, mlflow_ui_command
from ..trackers.run_record import read_run_views


def highlight_page(step: int) -> str:
    return f"spikes/highlight/step_{step:06d}.html"


def event_page(step: int) -> str:
    """The spike's row of ``spikes/events`` as MLflow's UI shows it (a table; see ``trackers.csv_view``)."""
    return f"spikes/events/step_{step:06d}.csv"


def where_to_look(run_dir: Path, step: int | None = None, page: str | None = None) -> list[str]:
    """MLflow run link (to artifact ``page`` of the run; default: the step's highlight page), W&B run,
    local files: whatever this run has."""
    record = read_run_views(run_dir)
    out = []
    if step is not None and page is None:
        page = highlight_page(step)
    m = record.get("mlflow", {})
    url = mlflow_run_url(m, f"artifacts/{page}" if page else "")
    if url is not None:  # a view without its run's ids yet has no address to show
        out.append(f"MLflow run {m.get('run_name', '')} ({m.get('run_id')}): {url}")
    if "wandb" in record:
        w = record["wandb"]
        where = f" (offline: {w.get('dir')})" if w.get("offline") else f": {w.get('url')}"
        out.append(f"W&B run {w.get('path')}{where}")
    from ..trackers.join import is_scratch

    if is_scratch(run_dir):  # removed when the run ends: never shown as a place to look
        return out or ["no run dir: pass run_dir= to keep this run's files"]
    local = run_dir / "spikes"
    if local.is_dir():
        out.append(f"local files: {local}")
    elif (run_dir / "rendered").is_dir():
        out.append(f"local files: {run_dir / 'rendered'}")
    if not out:
        out.append(f"run dir: {run_dir}")
    return out


def spike_link(run_dir: Path, step: int, localized: bool) -> str | None:
    """The MLflow link to a spike's page: its highlight when localized, else its ``spikes/events`` row."""
    m = read_run_views(run_dir).get("mlflow")
    if m is None:
        return None
    return mlflow_run_url(m, f"artifacts/{highlight_page(step) if localized else event_page(step)}")


def view_commands(run_dir: Path) -> list[str]:
    """The exact commands to look at the results."""
    record = read_run_views(run_dir)
    out = []
    if "mlflow" in record:
        m = record["mlflow"]
        cmd = mlflow_ui_command(str(m["tracking_uri"])) if m.get("tracking_uri") else None
        if cmd:
            out.append(f"  {cmd}    # the UI takes ~30-60 s to start; then open")
        for url, note in ((mlflow_run_url(m), ""),
                          (mlflow_charts_url(m), "    # every run of the experiment, charts overlaid")):
            if url is not None:  # a view without its run's ids yet has no address to show
                out.append(f"  {url}{note}")
    if "wandb" in record and record["wandb"].get("offline"):
        out.append(f"  wandb sync {record['wandb'].get('dir')}    # upload the offline W&B run")
    out.append(f"  gradloc-track report {run_dir} -o spike_report.html    # one HTML page, no server needed")
    return out
