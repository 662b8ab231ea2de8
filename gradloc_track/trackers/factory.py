"""Build the tracker a ``TrackerConfig`` describes."""
from __future__ import annotations

import tempfile
import threading
from pathlib import Path

from ..config import TrackerConfig
from ..config.tracker import TRACKER_KINDS
from . import sigterm
from .async_writer import AsyncTracker
from .base import NullTracker, Tracker
from .fanout import as_one_tracker
from .local_tracker import LocalTracker
from .memory import MemoryTracker


def _require_backend(kind: str) -> None:
    """Fail fast, in the caller's thread, when the backend's package is missing."""
    from .._optional import require

    require(kind, kind)


def make_tracker(cfg: TrackerConfig, run_dir=None, run_name=None) -> Tracker:
    """The run's tracker. Runs opened here are finished as KILLED on SIGTERM (see ``sigterm``)."""
    tracker = _make(cfg, run_dir, run_name)
    if not isinstance(tracker, (NullTracker, MemoryTracker)):
        sigterm.guard(tracker)
    return tracker


def _make(cfg: TrackerConfig, run_dir=None, run_name=None) -> Tracker:
    name = run_name or cfg.run_name
    if cfg.kind == "none":
        return LocalTracker(run_dir, finish_timeout_s=cfg.finish_timeout_s) if run_dir is not None else NullTracker()
    if cfg.kind == "memory":
        return MemoryTracker(run_dir)
    if cfg.kind not in TRACKER_KINDS:
        raise ValueError(f"tracker.kind={cfg.kind!r} is unknown: use one of {TRACKER_KINDS}")
    run_dir = Path(run_dir) if run_dir is not None else Path(tempfile.mkdtemp(prefix="gradloc-track-"))
    trackers: list[Tracker] = []
    if cfg.kind in ("mlflow", "both"):
        trackers.append(_mlflow(cfg, run_dir, name))
    if cfg.kind in ("wandb", "both"):
        trackers.append(_wandb(cfg, run_dir, name))
    return as_one_tracker(trackers)


def _mlflow(cfg: TrackerConfig, run_dir: Path, name: str | None) -> AsyncTracker:
    _require_backend("mlflow")
    from .mlflow_tracker import MlflowTracker, resolve_tracking_uri

    m = cfg.mlflow
    spec = {"tracking_uri": resolve_tracking_uri(m.tracking_uri), "experiment_name": m.experiment_name,
            "run_name": name, "tags": dict(m.tags)}
    cancel = threading.Event()
    return AsyncTracker.from_config(cfg, "mlflow", lambda: MlflowTracker(**spec, run_dir=run_dir, cancel=cancel),
                                    run_dir, spec, cancel)


def _wandb(cfg: TrackerConfig, run_dir: Path, name: str | None) -> AsyncTracker:
    _require_backend("wandb")
    from .wandb_tracker import WandbTracker

    w = cfg.wandb
    spec = {"project": w.project, "entity": w.entity, "tags": list(w.tags), "mode": w.mode, "dir": w.dir,
            "group": w.group, "run_name": name}
    return AsyncTracker.from_config(cfg, "wandb", lambda: WandbTracker(**spec, run_dir=run_dir), run_dir, spec)
