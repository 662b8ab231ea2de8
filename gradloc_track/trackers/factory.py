"""``make_tracker``: the run a ``TrackerConfig`` describes, opened through ``trackers.join``."""
from __future__ import annotations

from dataclasses import replace

from ..config import TrackerConfig
from .interface import Tracker
from .join import OnOpen, RunDir, open_run
from .naming import SPIKE_COUNT_OFF


def make_tracker(cfg: TrackerConfig, run_dir=None, run_name=None, on_open: OnOpen | None = None) -> Tracker:
    """The run's tracker. Runs opened here are finished as KILLED on SIGTERM (see ``sigterm``).

    One run per run directory: ``RunDirInUse`` when another run writes ``run_dir`` (``run_lock``).
    Without ``run_dir`` a temporary one holds the spool; it is removed at ``finish()`` unless it
    holds records for ``gradloc-track replay``. (It never joins an open run: ``watch()`` does.)
    """
    return open_run(cfg, RunDir(run_dir), run_name, on_open)


def without_spike_detection(cfg: TrackerConfig) -> TrackerConfig:
    """``cfg`` for a run without a spike detector: the MLflow run it opens is tagged ``spike_count`` "off" (it
    looked for no spike), not 0 (a run checked and found clean; held-out tester, stop 63). A user's own
    ``spike_count`` tag stays."""
    return replace(cfg, mlflow=replace(cfg.mlflow, tags={"spike_count": SPIKE_COUNT_OFF, **dict(cfg.mlflow.tags)}))
