"""Join the run that is already open instead of opening a second one.

``open_run_tracker()`` finds ``wandb.run`` / ``mlflow.active_run()`` (only if the user's process
already imported that SDK: we never import a backend to look) and returns a tracker that logs
into it and leaves it open at ``finish()``. The adapters do the attaching
(``MlflowTracker(run_id=...)``, ``WandbTracker(run=...)``); the background writer keeps a slow
server from stalling the step, as for runs we open.

Our files for a joined run (the run record, rendered heatmaps, the spool) need a directory; when
the user gave none, a ``ScratchDir`` holds them and is removed once the handle is finished: the
run itself lives in the user's W&B/MLflow run, not there.
"""
from __future__ import annotations

import logging
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from ..config import TrackerConfig
from ..trackers.async_writer import AsyncTracker
from ..trackers.base import Tracker
from ..trackers.fanout import as_one_tracker


log = logging.getLogger(__name__)


class ScratchDir:
    """A temporary directory made on first use and removed by ``remove()``, unless records the
    backend did not take are spooled in it (then it is kept, and named, for ``gradloc-track replay``)."""

    def __init__(self) -> None:
        self._path: Path | None = None

    @property
    def path(self) -> Path:
        if self._path is None:
            self._path = Path(tempfile.mkdtemp(prefix="gradloc-track-"))
        return self._path

    def spooled(self) -> list[Path]:
        """Spool files holding records (what ``gradloc-track replay`` would send)."""
        if self._path is None:
            return []
        return [p for p in (self._path / "spool").glob("*.jsonl") if p.is_file() and p.stat().st_size > 0]

    def remove(self) -> None:
        if self._path is None or not self._path.exists():
            return
        spooled = self.spooled()
        if spooled:
            log.warning("gradloc-track: keeping %s: %d spool file(s) hold records the backend did not take; "
                        "send them with `gradloc-track replay %s`", self._path, len(spooled), self._path)
            return
        shutil.rmtree(self._path, ignore_errors=True)
        self._path = None


def _run_dir(run_dir: Any) -> Path:
    return Path(run_dir) if run_dir is not None else Path(tempfile.mkdtemp(prefix="gradloc-track-"))


def mlflow_run_tracker(run_id: str, tracking_uri: str, cfg: TrackerConfig | None = None,
                       run_dir: Any = None) -> Tracker:
    """Log into the MLflow run ``run_id`` (explicit id through ``MlflowClient``; left open).

    Through the same background writer (bounded calls, spool, replay) as the runs we open.
    """
    from ..trackers.mlflow_tracker import MlflowTracker

    run_dir = _run_dir(run_dir)
    return AsyncTracker.from_config(cfg or TrackerConfig(), "mlflow",
                                    lambda: MlflowTracker(tracking_uri, run_dir=run_dir, run_id=run_id), run_dir,
                                    {"tracking_uri": tracking_uri, "run_id": run_id})


def wandb_run_tracker(run: Any, step_key: str = "train/step", cfg: TrackerConfig | None = None,
                      run_dir: Any = None) -> Tracker:
    """Log into the W&B run object ``run`` at ``step_key`` (the owner's step metric; left open)."""
    from ..trackers.wandb_tracker import WandbTracker

    run_dir = _run_dir(run_dir)
    tracker = WandbTracker(run=run, step_key=step_key, run_dir=run_dir)  # define_metric now, in order
    return AsyncTracker.from_config(cfg or TrackerConfig(), "wandb", lambda: tracker, run_dir,
                                    {"project": getattr(run, "project", None), "entity": getattr(run, "entity", None)})


def open_runs() -> dict[str, Any]:
    """``{"wandb": run, "mlflow": (run_id, tracking_uri)}`` for the runs open in this process."""
    found: dict[str, Any] = {}
    wandb = sys.modules.get("wandb")
    if wandb is not None and getattr(wandb, "run", None) is not None:
        found["wandb"] = wandb.run
    mlflow = sys.modules.get("mlflow")
    if mlflow is not None and hasattr(mlflow, "active_run"):
        active = mlflow.active_run()
        if active is not None:
            found["mlflow"] = (active.info.run_id, mlflow.get_tracking_uri())
    return found


def open_run_tracker(cfg: TrackerConfig | None = None, run_dir: Any = None,
                     wandb_step_key: str = "train/step") -> Tracker | None:
    """A tracker into every run already open (W&B and/or MLflow), or None when none is."""
    runs = open_runs()
    trackers: list[Tracker] = []
    if "mlflow" in runs:
        trackers.append(mlflow_run_tracker(*runs["mlflow"], cfg=cfg, run_dir=run_dir))
    if "wandb" in runs:
        trackers.append(wandb_run_tracker(runs["wandb"], wandb_step_key, cfg=cfg, run_dir=run_dir))
    return as_one_tracker(trackers)
