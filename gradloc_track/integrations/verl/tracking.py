"""Where a verl step's metrics and artifacts go: verl's own ``Tracking`` run.

Metrics ride back with verl's: the monitor's ``log_metrics`` calls are held (``VerlMetrics``) and
the session puts them into the engine's ``train_batch`` output, so verl's worker gathers them
over data-parallel ranks and its trainer logs them through ``verl.utils.tracking.Tracking`` with
its own ``actor/*`` metrics (``actor/grad_norm/global``, ``actor/clip/...``, ``actor/spike/...``),
at verl's step, into its one W&B/MLflow run. Artifacts (the culprit table, highlight page,
events) are uploaded by rank 0 into that same run, joined by ``join_verl_run``: the run open in
this process (``mlflow.active_run()``, ``wandb.run``: ``Tracking`` opened it here), else the
MLflow run ``MLFLOW_RUN_ID`` names (verl's ``Tracking`` joins that id too, so setting it for the
driver and the Ray workers puts both in one run), else the tracker the node configures.
"""
from __future__ import annotations

import os
import warnings
from typing import Any, Mapping

from ...trackers.interface import NullTracker, Tracker
from ..options import WatchOptions


class VerlMetrics(Tracker):
    """Holds ``log_metrics`` for verl's output; everything else goes to ``inner`` (the joined run)."""

    def __init__(self, inner: Tracker) -> None:
        self.inner = inner
        self.pending: dict[str, float] = {}

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self.pending.update({k: float(v) for k, v in metrics.items()})  # host floats already (the monitor's one sync)

    def take(self) -> dict[str, float]:
        out, self.pending = self.pending, {}
        return out

    def log_params(self, params):
        self.inner.log_params(params)

    def log_table(self, key, columns, rows, step=None):
        self.inner.log_table(key, columns, rows, step)

    def log_html(self, key, html, step=None):
        self.inner.log_html(key, html, step)

    def log_image(self, key, path, step=None):
        self.inner.log_image(key, path, step)

    def log_artifact(self, path, artifact_path=None):
        self.inner.log_artifact(path, artifact_path)

    def set_tags(self, tags):
        self.inner.set_tags(tags)

    def submit(self, job) -> None:
        submit = getattr(self.inner, "submit", None)
        submit(job) if callable(submit) else job(self)

    def flush(self, timeout_s: float | None = None) -> None:
        self.inner.flush(timeout_s)

    def finish(self, status: str = "success", timeout_s: float | None = None) -> None:
        self.inner.finish(status, timeout_s)


def join_verl_run(opts: WatchOptions, rank: int, run_dir: Any) -> tuple[Tracker, bool]:
    """(tracker for the artifacts, whether we own it). The one place this adapter joins a run
    (``gradloc_track/trackers/join.py`` takes this over when it lands)."""
    from ..runs import mlflow_run_tracker, open_run_tracker

    if rank != 0:
        return NullTracker(), True  # only rank 0 writes artifacts
    if isinstance(opts.tracker, Tracker):
        return opts.tracker, False
    run_dir = opts.run_dir if opts.run_dir is not None else run_dir
    if opts.tracker_auto:
        joined = open_run_tracker(opts.tracker, run_dir)
        if joined is None and os.environ.get("MLFLOW_RUN_ID"):
            uri = os.environ.get("MLFLOW_TRACKING_URI", "sqlite:////tmp/mlruns.db")  # verl Tracking's default
            joined = mlflow_run_tracker(os.environ["MLFLOW_RUN_ID"], uri, opts.tracker, run_dir)
        if joined is not None:
            return joined, True
        warnings.warn("gradloc-track: no W&B/MLflow run is open in this process and MLFLOW_RUN_ID is not set: metrics "
                      "go through verl's Tracking, spike artifacts are not uploaded (set MLFLOW_RUN_ID for verl's "
                      "driver and workers, or gradloc.tracker=mlflow|wandb)", UserWarning, stacklevel=3)
        return NullTracker(), True
    from ...trackers import make_tracker

    return make_tracker(opts.tracker, run_dir=opts.run_dir, run_name=opts.run_name), True
