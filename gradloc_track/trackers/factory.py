"""``make_tracker``: the run a ``TrackerConfig`` describes, opened through ``trackers.join``."""
from __future__ import annotations

from ..config import TrackerConfig
from .interface import Tracker
from .join import OnOpen, RunDir, open_run


def make_tracker(cfg: TrackerConfig, run_dir=None, run_name=None, on_open: OnOpen | None = None) -> Tracker:
    """The run's tracker. Runs opened here are finished as KILLED on SIGTERM (see ``sigterm``).

    One run per run directory: ``RunDirInUse`` when another run writes ``run_dir`` (``run_lock``).
    Without ``run_dir`` a temporary one holds the spool; it is removed at ``finish()`` unless it
    holds records for ``gradloc-track replay``. (It never joins an open run: ``watch()`` does.)
    """
    return open_run(cfg, RunDir(run_dir), run_name, on_open)
