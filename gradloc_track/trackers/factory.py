"""Build the tracker a ``TrackerConfig`` describes."""
from __future__ import annotations

import tempfile
from pathlib import Path

from ..config import TrackerConfig
from ..config.tracker import TRACKER_KINDS
from .async_writer import AsyncTracker
from .base import NullTracker, Tracker
from .fanout import FanoutTracker
from .local_tracker import LocalTracker
from .memory import MemoryTracker


def _require_backend(kind: str) -> None:
    """Fail fast, in the caller's thread, when the backend's package is missing."""
    from .._optional import require

    require(kind, kind)


def _async(cfg: TrackerConfig, name: str, factory, run_dir: Path) -> AsyncTracker:
    return AsyncTracker(factory, name, run_dir, queue_size=cfg.queue_size,
                        flush_interval_s=cfg.flush_interval_s, retries=cfg.retries,
                        retry_backoff_s=cfg.retry_backoff_s)


def make_tracker(cfg: TrackerConfig, run_dir=None, run_name=None) -> Tracker:
    name = run_name or cfg.run_name
    if cfg.kind == "none":
        return LocalTracker(run_dir) if run_dir is not None else NullTracker()
    if cfg.kind == "memory":
        return MemoryTracker(run_dir)
    if cfg.kind not in TRACKER_KINDS:
        raise ValueError(f"tracker.kind={cfg.kind!r} is unknown: use one of {TRACKER_KINDS}")
    run_dir = Path(run_dir) if run_dir is not None else Path(tempfile.mkdtemp(prefix="gradloc-track-"))
    trackers: list[Tracker] = []
    if cfg.kind in ("mlflow", "both"):
        _require_backend("mlflow")
        from .mlflow_tracker import MlflowTracker

        m = cfg.mlflow
        trackers.append(_async(cfg, "mlflow", lambda: MlflowTracker(
            m.tracking_uri, m.experiment_name, name, m.tags, run_dir=run_dir), run_dir))
    if cfg.kind in ("wandb", "both"):
        _require_backend("wandb")
        from .wandb_tracker import WandbTracker

        w = cfg.wandb
        trackers.append(_async(cfg, "wandb", lambda: WandbTracker(
            w.project, w.entity, w.tags, w.mode, w.dir, w.group, name, run_dir=run_dir), run_dir))
    return trackers[0] if len(trackers) == 1 else FanoutTracker(trackers)
