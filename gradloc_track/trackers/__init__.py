"""Tracker destinations. Backends (wandb, mlflow) are imported only when built."""
from .base import NullTracker, Tracker
from .fanout import FanoutTracker, as_one_tracker
from .local_tracker import LocalTracker
from .memory import MemoryTracker
from .replay import replay_run_dir, replay_spool
from .spool import read_spool

__all__ = ["Tracker", "NullTracker", "MemoryTracker", "FanoutTracker", "LocalTracker", "make_tracker",
           "as_one_tracker", "replay_spool", "replay_run_dir", "read_spool"]


def make_tracker(cfg, run_dir=None, run_name=None) -> Tracker:
    """Build the tracker a ``TrackerConfig`` describes (lazy: imports the backend here)."""
    from .factory import make_tracker as _make

    return _make(cfg, run_dir=run_dir, run_name=run_name)
