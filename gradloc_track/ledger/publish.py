"""Log a ledger to a tracker as its own run (``--log-to mlflow|wandb``), through the library's trackers.

One run named ``culprit-ledger`` (``--run-name``): table ``ledger/samples`` (one row per blamed
sample; MLflow: ``ledger/samples/step_000000.json``, W&B: a table panel), table ``ledger/by_<column>``
with ``--by``, the HTML page as artifact, the sources and counts as params. The tracker's own run
directory (its ``tracker/<backend>.json`` says where the run went) is ``<out>/ledger_run``.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from ..config import TrackerConfig
from ..config.tracker import MlflowConfig, WandbConfig
from .aggregate import Ledger
from .render import as_rows

TABLE_KEY = "ledger/samples"


def log_ledger(backend: str, out_dir: str | Path, ledger: Ledger, samples: list[dict], groups: list[dict] | None,
               by: str | None, sources: Sequence[str], tracking_uri: str | None = None,
               experiment: str = "gradloc-track", project: str = "gradloc-track",
               run_name: str = "culprit-ledger") -> dict[str, Any]:
    """Log the ledger as one run of ``backend``; returns where it went (``{backend: view}``)."""
    from ..trackers import make_tracker
    from ..trackers.run_record import read_run_views

    cfg = TrackerConfig(kind=backend, run_name=run_name,
                        mlflow=MlflowConfig(tracking_uri=tracking_uri, experiment_name=experiment),
                        wandb=WandbConfig(project=project))
    run_dir = Path(out_dir) / "ledger_run"
    tracker = make_tracker(cfg, run_dir=run_dir)
    status = "failed"
    try:
        tracker.log_params({"ledger.sources": ", ".join(map(str, sources)), "ledger.runs": len(ledger.runs),
                            "ledger.spike_events": ledger.events, "ledger.samples": len(samples),
                            **({"ledger.by": by} if by else {})})
        if samples:
            tracker.log_table(TABLE_KEY, *as_rows(samples))
        if by is not None and groups:
            tracker.log_table(f"ledger/by_{by}", *as_rows(groups))
        page = Path(out_dir) / "culprits.html"
        if page.is_file():
            tracker.log_artifact(page, "ledger")
        status = "success"
    finally:
        tracker.finish(status)
    return read_run_views(run_dir)
