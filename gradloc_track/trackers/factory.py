"""Build the tracker a ``TrackerConfig`` describes."""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Callable

from ..config import TrackerConfig
from ..config.tracker import TRACKER_KINDS
from . import sigterm
from .async_writer import AsyncTracker
from .async_writer.opener import OpenGate
from .interface import NullTracker, Tracker
from .fanout import as_one_tracker
from .local_tracker import LocalTracker
from .memory_tracker import MemoryTracker
from .run_lock import RunOwner

#: called once per backend when its run exists (``watch()`` says where the run went)
OnOpen = Callable[[Tracker], None]


def _require_backend(kind: str) -> None:
    """Fail fast, in the caller's thread, when the backend's package is missing."""
    from .._optional import require

    require(kind, kind)


def make_tracker(cfg: TrackerConfig, run_dir=None, run_name=None, on_open: OnOpen | None = None) -> Tracker:
    """The run's tracker. Runs opened here are finished as KILLED on SIGTERM (see ``sigterm``).

    One run per run directory: ``RunDirInUse`` when another run writes ``run_dir`` (``run_lock``).
    Without ``run_dir`` a temporary one holds the spool; it is removed at ``finish()`` unless it
    holds records for ``gradloc-track replay``.
    """
    tracker = _make(cfg, run_dir, run_name, on_open)
    if not isinstance(tracker, (NullTracker, MemoryTracker)):
        sigterm.guard(tracker)
    return tracker


def temporary_run_dir() -> tuple[Path, RunOwner]:
    """A run directory for a run the user gave none, removed when the run ends (unless it holds a spool)."""
    return Path(tempfile.mkdtemp(prefix="gradloc-track-")), RunOwner(temporary=True)


def _make(cfg: TrackerConfig, run_dir=None, run_name=None, on_open: OnOpen | None = None) -> Tracker:
    name = run_name or cfg.run_name
    if cfg.kind == "none":
        return LocalTracker(run_dir, finish_timeout_s=cfg.finish_timeout_s) if run_dir is not None else NullTracker()
    if cfg.kind == "memory":
        return MemoryTracker(run_dir)
    if cfg.kind not in TRACKER_KINDS:
        raise ValueError(f"tracker.kind={cfg.kind!r} is unknown: use one of {TRACKER_KINDS}")
    for kind in ("mlflow", "wandb"):  # both packages there before a writer holds the run dir
        if cfg.kind in (kind, "both"):
            _require_backend(kind)
    run_dir, owner = (Path(run_dir), RunOwner()) if run_dir is not None else temporary_run_dir()
    trackers: list[Tracker] = []
    if cfg.kind in ("mlflow", "both"):
        trackers.append(_mlflow(cfg, run_dir, name, owner, on_open))
    if cfg.kind in ("wandb", "both"):
        trackers.append(_wandb(cfg, run_dir, name, owner, on_open))
    return as_one_tracker(trackers)


def _mlflow(cfg: TrackerConfig, run_dir: Path, name: str | None, owner: RunOwner, on_open: OnOpen | None
            ) -> AsyncTracker:
    from .mlflow_tracker import MlflowTracker, resolve_tracking_uri

    m = cfg.mlflow
    spec = {"tracking_uri": resolve_tracking_uri(m.tracking_uri), "experiment_name": m.experiment_name,
            "run_name": name, "tags": dict(m.tags)}
    gate = OpenGate()
    return AsyncTracker.from_config(cfg, "mlflow", lambda: MlflowTracker(**spec, run_dir=run_dir, cancel=gate),
                                    run_dir, spec, gate, owner, on_open)


def _wandb(cfg: TrackerConfig, run_dir: Path, name: str | None, owner: RunOwner, on_open: OnOpen | None
           ) -> AsyncTracker:
    from .wandb_tracker import WandbTracker

    w = cfg.wandb
    spec = {"project": w.project, "entity": w.entity, "tags": list(w.tags), "mode": w.mode, "dir": w.dir,
            "group": w.group, "run_name": name}
    gate = OpenGate()
    return AsyncTracker.from_config(cfg, "wandb", lambda: WandbTracker(**spec, run_dir=run_dir, cancel=gate),
                                    run_dir, spec, gate, owner, on_open)
