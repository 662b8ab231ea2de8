"""Tracker configs (group ``tracker``)."""
from __future__ import annotations

import pkgutil
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from ._validate import check, check_types, one_of


def backend_names() -> tuple[str, ...]:
    """The backends' names: one module each in ``trackers/backends``, named by its file. Read from the
    folder, not imported (this layer may not import the trackers); ``tests/trackers/test_backends.py``
    checks that each module registers its file's name."""
    folder = Path(__file__).resolve().parent.parent / "trackers" / "backends"
    return tuple(sorted(m.name for m in pkgutil.iter_modules([str(folder)]) if m.name != "base"
                        and not m.name.startswith("_")))


#: ``tracker.kind``: the backends (``backend_names``), ``both`` (MLflow and W&B), ``none`` (the run dir's
#: files), ``memory``
TRACKER_KINDS = ("none", *backend_names(), "both", "memory")
#: the longest wait the platform's locks can make (~9.2e9 s on 64-bit Linux); longer raises OverflowError
MAX_WAIT_S = threading.TIMEOUT_MAX


def _seconds(name: str, value, zero_ok: bool = False) -> None:
    low = "0 or more" if zero_ok else "a positive number of"
    ok = isinstance(value, (int, float)) and (0 <= value if zero_ok else 0 < value) and value <= MAX_WAIT_S
    check(ok, f"tracker.{name}", value, f"use {low} seconds, at most {MAX_WAIT_S:g} (threading.TIMEOUT_MAX, the "
          "longest wait this platform can make; ~292 years)")


@dataclass
class WandbConfig:
    project: str = "gradloc-track"
    entity: Optional[str] = None
    tags: list[str] = field(default_factory=list)
    # None = follow W&B's own resolution (WANDB_MODE, else "online"); tests use "offline"
    mode: Optional[str] = None
    dir: Optional[str] = None  # None = WANDB_DIR, else the run directory (without one: ./wandb)
    group: Optional[str] = None

    def __post_init__(self) -> None:
        check_types(self, "tracker.wandb")
        check(self.project.strip() != "", "tracker.wandb.project", self.project, "use a non-empty project name")
        if self.mode is not None:
            one_of("tracker.wandb.mode", self.mode, ("online", "offline", "disabled"))


@dataclass
class MlflowConfig:
    # None = MLflow's own resolution: MLFLOW_TRACKING_URI, else sqlite:///./mlflow.db
    tracking_uri: Optional[str] = None
    experiment_name: str = "gradloc-track"
    tags: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_types(self, "tracker.mlflow")
        check(self.experiment_name.strip() != "", "tracker.mlflow.experiment_name", self.experiment_name,
              "use a non-empty experiment name")
        if self.tracking_uri is not None:
            check(self.tracking_uri.strip() != "", "tracker.mlflow.tracking_uri", self.tracking_uri,
                  "use a URI (e.g. sqlite:///mlflow.db or http://127.0.0.1:5000) or null")


@dataclass
class TrackerConfig:
    kind: str = "none"
    run_name: Optional[str] = None
    wandb: WandbConfig = field(default_factory=WandbConfig)
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)
    # background writer
    queue_size: int = 10000  # records held before the producer blocks briefly / spills
    flush_interval_s: float = 1.0  # metrics written once per interval (or when a request is full), never per step
    retries: int = 3  # quick failures retried within call_timeout_s
    retry_backoff_s: float = 0.5
    # OUR bound on one backend call (the SDK's own retries, left at their defaults, take minutes);
    # a call that fails or times out marks the backend down: records go to the spool at once
    call_timeout_s: float = 10.0
    open_timeout_s: float = 120.0  # the first call (creating the run; a new SQLite store takes seconds)
    probe_interval_s: float = 30.0  # while down, try the backend again this often
    finish_timeout_s: float = 120.0  # finish() returns within this; the rest is spooled for replay

    def __post_init__(self) -> None:
        check_types(self, "tracker")
        one_of("tracker.kind", self.kind, TRACKER_KINDS)
        check(self.queue_size > 0, "tracker.queue_size", self.queue_size, "use a positive integer")
        check(self.retries >= 0, "tracker.retries", self.retries, "use 0 or more")
        _seconds("retry_backoff_s", self.retry_backoff_s, zero_ok=True)
        for name in ("flush_interval_s", "call_timeout_s", "open_timeout_s", "probe_interval_s",
                     "finish_timeout_s"):
            _seconds(name, getattr(self, name))
