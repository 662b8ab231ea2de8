"""MLflow as a backend entry (the adapter is ``trackers.mlflow_tracker``, the links ``trackers.mlflow_links``).

A run is an explicit run id in a tracking store; a run dir's record leads to it; the report downloads
its ``spikes/`` artifacts (the shared layout) into a temp dir; replay continues it by id and ends one
whose process died as KILLED.
"""
from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path
from typing import Any

from ..bounded import CallTimeout, bounded_call
from ..naming import DETECTION_OFF, SAME_RUN_KEY, SAME_RUN_TAG, SPIKE_COUNT_OFF
from .base import Backend, NoSpikeEvents, ReportSourceError, RunFiles

MLFLOW_WAIT_S = 20.0  # our bound on waiting for an MLflow store/server (its own retries take minutes)
RUN_ID = re.compile(r"^[0-9a-f]{32}$")


class RunNotInStore(ReportSourceError):
    """The run id is not in that store (another store may hold it: a run dir's own record)."""


def _bounded(fn, what: str, timeout_s: float | None = None):
    """``fn()`` on a daemon thread; give up after ``timeout_s`` (MLflow's own retries can take minutes)."""
    timeout_s = MLFLOW_WAIT_S if timeout_s is None else timeout_s
    try:
        return bounded_call(fn, timeout_s, name="gradloc-report-mlflow")
    except CallTimeout:
        raise ReportSourceError(f"{what}: no answer within {timeout_s:.0f} s (server down or unreachable?); "
                                "check --tracking-uri, or pass the run directory instead") from None


def _probe(uri: str, timeout_s: float = 5.0) -> None:
    """Fail fast on a server that is not there (connection refused / no route), before MLflow's retries."""
    import socket
    import urllib.parse

    u = urllib.parse.urlparse(uri)
    port = u.port or (443 if u.scheme == "https" else 80)
    try:
        socket.create_connection((u.hostname, port), timeout=timeout_s).close()
    except OSError as exc:
        raise ReportSourceError(f"MLflow server {uri} is unreachable ({exc}); start it, "
                                "or pass the run directory") from exc


def fetch_run(run_id: str, tracking_uri: str | None) -> RunFiles:
    """Download the run's ``spikes/`` artifacts into a temp dir (removed by the reader once read)."""
    import shutil

    from ..._optional import require
    from ..mlflow_links import mlflow_run_url
    from ..mlflow_tracker import resolve_tracking_uri

    uri = resolve_tracking_uri(tracking_uri)
    if uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///"):]).is_file():
        # MlflowClient would create an empty store here: say what is missing instead
        raise RunNotInStore(f"{run_id!r} is neither a run directory nor a run in an MLflow store: there is no "
                                f"store at {uri}; pass a run directory, or --tracking-uri pointing at the run's store")
    if uri.startswith(("http://", "https://")):
        _probe(uri)
    require("mlflow", "mlflow")
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    try:
        run = _bounded(lambda: client.get_run(run_id), f"MLflow at {uri}")
    except MlflowException as exc:
        raise RunNotInStore(
            f"{run_id!r} is neither a run directory nor a run in the MLflow store {uri} "
            f"({exc.message.splitlines()[0]}); "
            "pass a local run directory, or an MLflow run id with --tracking-uri pointing at its store") from exc
    dst = Path(tempfile.mkdtemp(prefix="gradloc-report-"))
    try:
        _bounded(lambda: client.download_artifacts(run_id, "spikes", str(dst)), f"MLflow at {uri}", 120.0)
    except (MlflowException, OSError) as exc:
        shutil.rmtree(dst, ignore_errors=True)
        off = (run.data.tags or {}).get("spike_count") == SPIKE_COUNT_OFF  # (its spike detector was off)
        raise NoSpikeEvents(f"MLflow run {run_id} has no spikes/ artifacts: "
                            + (DETECTION_OFF if off else "it logged no spike events")) from exc
    info = {"tracking_uri": uri, "experiment_id": run.info.experiment_id, "run_id": run_id}
    same = (run.data.tags or {}).get(SAME_RUN_TAG)  # tracker=both: the identity its W&B sibling shares
    return RunFiles(dst, run.info.run_name or run_id, mlflow_run_url(info), temporary=True, run_id=run_id,
                    aliases=(run_id, SAME_RUN_KEY + same) if same else ())


class MlflowBackend(Backend):
    name = "mlflow"
    title = "MLflow"
    rank = 0  # a run's identity is its MLflow run id first

    def open(self, cfg, place, run_name, on_open):
        from ..async_writer import AsyncTracker
        from ..async_writer.opener import OpenGate
        from ..mlflow_tracker import MlflowTracker, resolve_tracking_uri

        m = cfg.mlflow
        tags = dict(m.tags) | ({SAME_RUN_TAG: place.same_run} if place.same_run else {})
        spec = {"tracking_uri": resolve_tracking_uri(m.tracking_uri), "experiment_name": m.experiment_name,
                "run_name": run_name, "tags": tags}
        gate, run_dir = OpenGate(), place.path
        return AsyncTracker.from_config(cfg, self.name, lambda: MlflowTracker(**spec, run_dir=run_dir, cancel=gate),
                                        run_dir, spec, gate, place.owner, on_open)

    def open_in_process(self) -> Any:
        mlflow = sys.modules.get("mlflow")
        if mlflow is None or not hasattr(mlflow, "active_run"):
            return None
        active = mlflow.active_run()
        return None if active is None else (active.info.run_id, mlflow.get_tracking_uri())

    def from_lightning(self, logger: Any) -> Any:
        if type(logger).__name__ != "MLFlowLogger":
            return None
        client = logger.experiment  # creates the logger's run if it is not there yet
        return (logger.run_id, client.tracking_uri)

    def join(self, found, step_key, cfg, run_dir, owner, on_open):
        """Log into the MLflow run ``found = (run_id, tracking_uri)`` (explicit id through ``MlflowClient``)."""
        from ..async_writer import AsyncTracker
        from ..mlflow_tracker import MlflowTracker

        run_id, tracking_uri = found
        self.require()
        return AsyncTracker.from_config(cfg, self.name,
                                        lambda: MlflowTracker(tracking_uri, run_dir=run_dir, run_id=run_id), run_dir,
                                        {"tracking_uri": tracking_uri, "run_id": run_id, "joined": True},
                                        owner=owner, on_open=on_open)

    def resume(self, run_dir, run, spec, tracking_uri):
        from ..mlflow_tracker import MlflowTracker

        uri = tracking_uri or run.get("tracking_uri") or spec.get("tracking_uri")
        if run.get("run_id"):
            return MlflowTracker.resume(run["run_id"], uri, run_dir=run_dir)
        return MlflowTracker(**{**spec, "tracking_uri": uri}, run_dir=run_dir)

    def end_if_orphaned(self, tracker) -> bool | None:
        return tracker.end_if_running("killed")

    def run_id(self, run_dir, where):
        return str(where["run_id"]) if where and where.get("run_id") else None

    def report_files(self, run_dir, where, tracking_uri):
        if not where or not where.get("run_id"):
            return None
        # --tracking-uri first (the store moved), then the store the run dir recorded: a ledger over run dirs of
        # several stores with one --tracking-uri reads each from its own (before: every other one was refused)
        uris = list(dict.fromkeys(u for u in (tracking_uri, where.get("tracking_uri")) if u)) or [None]
        misses = []
        for uri in uris:
            try:
                return fetch_run(where["run_id"], uri)
            except RunNotInStore as exc:
                misses.append(str(exc))
        if len(uris) == 1:
            raise ReportSourceError(misses[0])
        raise ReportSourceError(f"{run_dir}: its MLflow run {where['run_id']} is neither in {uris[0]} (--tracking-uri) "
                                f"nor in {uris[1]} (the store it recorded); pass --tracking-uri pointing at its store")

    def find_run(self, text, tracking_uri):
        return fetch_run(text, tracking_uri)

    def link(self, where):
        from ..mlflow_links import mlflow_run_url

        return mlflow_run_url(where)

    def where(self, view, page):
        from ..mlflow_links import mlflow_run_url

        url = mlflow_run_url(view, f"artifacts/{page}" if page else "")
        if url is None:  # a view without its run's ids yet has no address to show
            return []
        return [f"MLflow run {view.get('run_name', '')} ({view.get('run_id')}): {url}"]

    def page_link(self, view, page):
        from ..mlflow_links import mlflow_run_url

        return mlflow_run_url(view, f"artifacts/{page}")

    def commands(self, view):
        from ..mlflow_links import mlflow_charts_url, mlflow_run_url, mlflow_ui_command

        out = []
        cmd = mlflow_ui_command(str(view["tracking_uri"])) if view.get("tracking_uri") else None
        if cmd:
            out.append(f"  {cmd}    # the UI takes ~30-60 s to start; then open")
        for url, note in ((mlflow_run_url(view), ""),
                          (mlflow_charts_url(view), "    # every run of the experiment, charts overlaid")):
            if url is not None:  # a view without its run's ids yet has no address to show
                out.append(f"  {url}{note}")
        return out
