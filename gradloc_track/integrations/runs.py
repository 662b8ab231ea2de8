"""Join the run that is already open instead of opening a second one.

``open_run_tracker()`` finds ``wandb.run`` / ``mlflow.active_run()`` (only if the user's process
already imported that SDK: we never import a backend to look) and returns a tracker that logs
into it and leaves it open at ``finish()``. The adapters do the attaching
(``MlflowTracker(run_id=...)``, ``WandbTracker(run=...)``); the background writer keeps a slow
server from stalling the step, as for runs we open.

Our files for a joined run (the run record, rendered heatmaps, the spool) need a directory; when
the user gave none, a ``ScratchDir`` holds them and is removed once the handle is finished: the
run itself lives in the user's W&B/MLflow run, not there. (Called with no directory at all, the
trackers here make a temporary one, removed at their ``finish()`` unless it holds a spool.)

The user's own ``wandb.run`` (no framework step metric given) is joined in shared-row mode: our
metrics ride in the user's rows at our x-axis ``gradloc/step``, and W&B's step stays the user's
(``trackers/wandb_shared.py``).
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
from ..trackers.interface import Tracker
from ..trackers.factory import temporary_run_dir
from ..trackers.fanout import as_one_tracker
from ..trackers.run_lock import RunOwner


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


def _run_dir(run_dir: Any, owner: RunOwner | None) -> tuple[Path, RunOwner]:
    """The run directory and the run owning it (a temporary directory, removed at finish, when none)."""
    if run_dir is None:
        return temporary_run_dir()
    return Path(run_dir), owner or RunOwner()


def mlflow_run_tracker(run_id: str, tracking_uri: str, cfg: TrackerConfig | None = None,
                       run_dir: Any = None, owner: RunOwner | None = None) -> Tracker:
    """Log into the MLflow run ``run_id`` (explicit id through ``MlflowClient``; left open).

    Through the same background writer (bounded calls, spool, replay) as the runs we open.
    """
    from ..trackers.mlflow_tracker import MlflowTracker

    run_dir, owner = _run_dir(run_dir, owner)
    return AsyncTracker.from_config(cfg or TrackerConfig(), "mlflow",
                                    lambda: MlflowTracker(tracking_uri, run_dir=run_dir, run_id=run_id), run_dir,
                                    {"tracking_uri": tracking_uri, "run_id": run_id, "joined": True}, owner=owner)


def wandb_run_tracker(run: Any, step_key: str | None = "train/step", cfg: TrackerConfig | None = None,
                      run_dir: Any = None, owner: RunOwner | None = None) -> Tracker:
    """Log into the W&B run object ``run`` at ``step_key`` (a framework's step metric; left open).

    ``step_key=None``: the user's own run, joined in shared-row mode (W&B's step stays theirs;
    metrics logged on the training thread, the rest through the background writer).
    """
    from ..trackers.wandb_shared import SharedRunTracker
    from ..trackers.wandb_tracker import WandbTracker

    run_dir, owner = _run_dir(run_dir, owner)
    adapter = WandbTracker(run=run, step_key=step_key or "", shared_rows=step_key is None,
                           run_dir=run_dir)  # define_metric now, in order
    writer = AsyncTracker.from_config(cfg or TrackerConfig(), "wandb", lambda: adapter, run_dir,
                                      {"project": getattr(run, "project", None), "entity": getattr(run, "entity", None),
                                       "joined": True}, owner=owner)
    return writer if step_key is not None else SharedRunTracker(adapter, writer)


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
                     wandb_step_key: str | None = None) -> Tracker | None:
    """A tracker into every run already open (W&B and/or MLflow), or None when none is.

    ``wandb_step_key``: the step metric of the framework that opened the W&B run (HF Trainer's);
    ``None``: the user's own run (shared-row mode).
    """
    runs = open_runs()
    if not runs:
        return None
    run_dir, owner = _run_dir(run_dir, None)  # one run of ours: its writers share the directory
    trackers: list[Tracker] = []
    if "mlflow" in runs:
        trackers.append(mlflow_run_tracker(*runs["mlflow"], cfg=cfg, run_dir=run_dir, owner=owner))
    if "wandb" in runs:
        trackers.append(wandb_run_tracker(runs["wandb"], wandb_step_key, cfg=cfg, run_dir=run_dir, owner=owner))
    return as_one_tracker(trackers)
