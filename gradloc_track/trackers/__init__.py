"""Tracker destinations. Backends (wandb, mlflow) are imported only when built.

- ``interface``: the interface, a destination whose methods do nothing by default; ``NullTracker``
- ``memory_tracker``, ``local_tracker``: in lists (tests, notebooks); in the run directory (``tracker=none``)
- ``backends``: the registry, one ``Backend`` entry per backend (open, join, replay, run identity,
  report files, links, closing lines) that every place loops over; ``backends/tensorboard`` is a
  whole backend in one file (adapter and entry)
- ``mlflow_tracker``, ``wandb_tracker``: the MLflow and W&B adapters (open a run, or join one); ``mlflow_links``
- ``wandb_shared``: the user's own W&B run joined: our records in their rows, W&B's step left to them
- ``fanout``: one stream of calls to several trackers; ``as_one_tracker``
- ``async_writer``: the background writer every backend runs behind (queue, bounded calls, spool)
- ``bounded``: a call on a thread with a deadline (the writer, the report, the SIGTERM handler)
- ``spool``, ``replay``: what a backend did not take, and sending it to the original run later
- ``run_record``: ``<run dir>/tracker/<backend>.json``, which backend run a run directory belongs to
- ``run_lock``: one run per run directory (``RunDirInUse``); a run whose process died is told apart
- ``join``: the one place a run is opened (``make_tracker``) or joined (``wandb.run``,
  ``mlflow.active_run()``, a framework's run), through the registry, with its run dir (a scratch one
  when none is given)
- ``sigterm``: runs end as KILLED on preemption; ``factory``: ``make_tracker`` from a ``TrackerConfig``
- ``files``, ``naming``: atomic file writes, whole-record appends; metric key names and cleaning
- ``quiet``: MLflow's store-creation lines and download bars off in our own commands
- ``table_json``, ``csv_view``: a table part as strict JSON (non-finite numbers kept) and as CSV (MLflow's viewer)
- ``spike_story``: the run page's story (the MLflow description, the W&B summary) of a run's spikes
- ``incomplete``, ``kept_writes``: a run dir some write could not complete, said; the failed writes kept for later
- ``reachable``: is a tracking server listening (asked once, before the SDK's first request)
"""
from __future__ import annotations

import importlib
import importlib.util as _util
from typing import Any as _Any

from .._lazy import lazy_names as _lazy_names
from .interface import NullTracker, Tracker

#: name -> the module that defines it, imported on first use: the CLI's readers need ``table_json`` and
#: ``files`` only, and the writer stack behind ``LocalTracker`` was half of ``culprits``' start-up
_names = _lazy_names(__name__, {n: f"{__name__}.{m}" for n, m in {
    "FanoutTracker": "fanout", "as_one_tracker": "fanout", "LocalTracker": "local_tracker",
    "MemoryTracker": "memory_tracker", "replay_run_dir": "replay", "replay_spool": "replay",
    "read_spool": "spool", "read_metrics": "local_tracker", "metrics_by_step": "local_tracker"}.items()})

__all__ = ["Tracker", "NullTracker", "MemoryTracker", "FanoutTracker", "LocalTracker", "make_tracker",
           "as_one_tracker", "replay_spool", "replay_run_dir", "read_spool", "read_metrics", "metrics_by_step"]


def __getattr__(name: str) -> _Any:
    """A public name, else a submodule (``gradloc_track.trackers.files`` after a plain ``import
    gradloc_track.trackers``, as when the package imported them all), imported on first use."""
    try:
        return _names(name)
    except AttributeError:
        if name.startswith("_") or "." in name or _util.find_spec(f"{__name__}.{name}") is None:
            raise
    return importlib.import_module(f"{__name__}.{name}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


def make_tracker(cfg, run_dir=None, run_name=None, on_open=None) -> Tracker:
    """Build the tracker a ``TrackerConfig`` describes (lazy: imports the backend here).
    ``on_open(backend)``: called once each backend run exists (e.g. to say where it is)."""
    from .factory import make_tracker as _make

    return _make(cfg, run_dir=run_dir, run_name=run_name, on_open=on_open)
