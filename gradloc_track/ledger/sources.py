"""Every run a ledger reads, with its culprit table: run dirs, W&B run dirs, MLflow runs and experiments.

A run is read by the report's own readers (``report.resolve_source`` finds its files, locally or
downloaded from MLflow; ``load_table`` / ``read_table`` read the table); an MLflow experiment is
expanded into its runs. The same run named twice (its run dir and its experiment) is read once.
"""
from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from ..artifacts.table_store import merge_tables, table_parts
from ..report import MLFLOW_WAIT_S, RUN_ID, ReportSourceError, load_table, resolve_source
from ..trackers.bounded import CallTimeout, bounded_call
from ..trackers.run_record import read_run_views


@dataclass
class RunTable:
    """One run's culprit table (``{"columns", "data"}``) and how to name the run."""

    name: str
    run_id: str
    table: dict[str, Any]


def _wandb_table(files: Path, notes: list[str]) -> dict[str, Any]:
    """The cumulative culprit table of a W&B run's ``files/`` (the largest ``*tokens*.table.json``)."""
    tables = sorted((files / "media" / "table").rglob("*.table.json"))
    tables = [t for t in tables if "tokens" in t.name] or tables
    loaded = [load_table(t, notes) for t in tables]
    return max(loaded, key=lambda t: len(t["data"]), default={"columns": [], "data": []})


def _run_id(source: str, root: Path, layout: str) -> str:
    """The MLflow run id when the run has one, else the W&B run folder or the run dir."""
    if RUN_ID.match(source):
        return source
    m = read_run_views(source).get("mlflow") if Path(source).is_dir() else None
    if m and m.get("run_id"):
        return m["run_id"]
    return root.parent.name if layout == "wandb" else str(Path(source).resolve())


def read_run(source: str, tracking_uri: str | None, notes: list[str]) -> RunTable | None:
    """One run (dir, W&B dir or MLflow run id); None (and a note) when it logged no spike event."""
    try:
        src = resolve_source(source, tracking_uri)
    except ReportSourceError as exc:
        if "no spikes/" in str(exc) or "logged no spike" in str(exc):
            notes.append(f"{source}: no spike events")
            return None
        raise
    try:
        if src.layout == "wandb":
            table = _wandb_table(src.root, src.notes)
        else:
            table = merge_tables(load_table(p, src.notes) for p in table_parts(src.root, "spikes/tokens"))
    finally:
        if src.temporary:
            shutil.rmtree(src.root, ignore_errors=True)
    notes.extend(f"{src.title}: {n}" for n in src.notes)
    return RunTable(src.title, _run_id(source, src.root, src.layout), table)


def experiment_runs(name: str, tracking_uri: str | None) -> list[str]:
    """The run ids of MLflow experiment ``name`` (or id), oldest first."""
    from .._optional import require
    from ..trackers.mlflow_tracker import resolve_tracking_uri

    uri = resolve_tracking_uri(tracking_uri)
    if uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///"):]).is_file():
        raise ReportSourceError(f"{name!r} is neither a run directory, a run id nor an experiment: there is no MLflow "
                                f"store at {uri}; pass --tracking-uri pointing at the experiment's store")
    require("mlflow", "mlflow")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)

    def find() -> Any:
        exp = client.get_experiment_by_name(name)
        if exp is None and re.fullmatch(r"\d+", name):
            exp = client.get_experiment(name)
        if exp is None:
            return None
        return [r.info.run_id for r in client.search_runs([exp.experiment_id], order_by=["attributes.start_time ASC"],
                                                           max_results=10000)]
    try:
        runs = bounded_call(find, MLFLOW_WAIT_S, name="gradloc-ledger-mlflow")
    except CallTimeout:
        raise ReportSourceError(f"MLflow at {uri}: no answer within {MLFLOW_WAIT_S:.0f} s") from None
    if runs is None:
        raise ReportSourceError(f"{name!r} is neither a run directory, an MLflow run id nor an experiment in {uri}; "
                                "pass run directories, run ids, or an experiment name with --tracking-uri")
    return runs


def read_runs(sources: Iterable[str], tracking_uri: str | None = None,
              notes: list[str] | None = None) -> list[RunTable]:
    """Every run named by ``sources`` (run dirs, W&B run dirs, MLflow run ids or experiment names)."""
    notes = notes if notes is not None else []
    out: list[RunTable] = []
    for source in sources:
        text = str(source)
        # a path (even one that is not there: the report says so) or a run id is one run; else an experiment
        is_run = Path(text).is_dir() or RUN_ID.match(text) or os.sep in text or text.startswith(".")
        for run in ([text] if is_run else experiment_runs(text, tracking_uri)):
            got = read_run(run, tracking_uri, notes)
            if got is not None and all(got.run_id != r.run_id for r in out):
                out.append(got)
    names = [r.name for r in out]
    for r in out:  # two runs with one name: tell them apart by their id
        if names.count(r.name) > 1:
            r.name = f"{r.name}#{Path(r.run_id).name[:8]}"
    return out
