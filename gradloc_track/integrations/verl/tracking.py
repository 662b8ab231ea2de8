"""Where a verl step's metrics and artifacts go: verl's own ``Tracking`` run.

Metrics ride back with verl's: the monitor's ``log_metrics`` calls are held (``VerlMetrics``) and
the session puts them into the engine's ``train_batch`` output, so verl's worker gathers them
over data-parallel ranks and its trainer logs them through ``verl.utils.tracking.Tracking`` with
its own ``actor/*`` metrics (``actor/grad_norm/global``, ``actor/clip/...``, ``actor/spike/...``),
at verl's step, into its one W&B/MLflow run. Artifacts (the culprit table, highlight page,
events) are uploaded by rank 0 into that same run.

Which run: ``verl_door`` names it and ``trackers.join`` (the one place a run is opened or joined)
joins it and records it in the run dir: the run open in this process (``mlflow.active_run()``,
``wandb.run``: ``Tracking`` opened it here), else the MLflow run ``MLFLOW_RUN_ID`` names (verl's
``Tracking`` joins that id too, so setting it for the driver and the Ray workers puts both in one
run), else what the node's ``tracker`` configures.
"""
from __future__ import annotations

import os
import warnings
from typing import Mapping

from ...trackers.interface import ForwardingTracker, Tracker
from ...trackers.join import OpenRuns, open_in_process
from ..handle import Door
from ..options import WatchOptions

VERL_MLFLOW_URI = "sqlite:////tmp/mlruns.db"  # verl Tracking's MLflow store when MLFLOW_TRACKING_URI is unset
NO_RUN = ("gradloc-track: no W&B/MLflow run is open in this process and MLFLOW_RUN_ID is not set: metrics go "
          "through verl's Tracking, spike artifacts are not uploaded (set MLFLOW_RUN_ID for verl's driver and "
          "workers, or gradloc.tracker=mlflow|wandb, or gradloc.run_dir=DIR for local files)")


class VerlMetrics(ForwardingTracker):
    """Holds ``log_metrics`` for verl's output; everything else goes to ``inner`` (the joined run)."""

    def __init__(self, inner: Tracker) -> None:
        super().__init__(inner)
        self.pending: dict[str, float] = {}

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self.pending.update({k: float(v) for k, v in metrics.items()})  # host floats already (the monitor's one sync)

    def take(self) -> dict[str, float]:
        out, self.pending = self.pending, {}
        return out


def verl_runs() -> OpenRuns:
    """verl's run: the one ``Tracking`` opened in this process, else the MLflow run ``MLFLOW_RUN_ID``
    names in ``MLFLOW_TRACKING_URI`` (verl's default store when unset). Names it; joins nothing."""
    runs = open_in_process()
    if runs.backends or not os.environ.get("MLFLOW_RUN_ID"):
        return runs
    return OpenRuns(mlflow=(os.environ["MLFLOW_RUN_ID"], os.environ.get("MLFLOW_TRACKING_URI", VERL_MLFLOW_URI)))


def verl_door(opts: WatchOptions, rank: int) -> Door:
    """The engine session's front door: ``step()`` called by the session, metrics held for verl's
    output (``VerlMetrics``, every rank), artifacts from rank 0 into verl's run (``verl_runs``)."""
    runs = verl_runs() if opts.tracker_auto and rank == 0 else None
    if runs is not None and not runs.backends and opts.run_dir is None and getattr(opts.tracker, "kind", "") == "none":
        warnings.warn(NO_RUN, UserWarning, stacklevel=3)
    return Door("verl's engine session", hook_optimizer=False, runs=runs, logs=rank == 0, wrap_tracker=VerlMetrics)
