"""Every run a ledger reads, with its culprit table: run dirs (and folders of them), W&B run folders,
MLflow runs and experiments.

A run is read by the report's own readers (``report.resolve_source`` finds its files, locally, in the
W&B folder or downloaded from MLflow; ``load_table`` reads each table file) and its rows checked
(``rows``). A folder that is no run dir is searched for the run dirs under it (``run_dirs``); a source
that yields no run (an empty folder, ``docs/``, an experiment without runs) is an error that says
what a run dir is. A run is identified by the run it logged to (``ReportSource.run_id``: the MLflow
run id, ``wandb:<id>``, else its resolved path), never by its folder's name: the same run named
twice (its dir and its experiment) is read once, and two runs with one name are both kept, shown
with a name that tells them apart (``sweepA/0_clip=adagc``, ``seed0#1a2b3c4d``).
"""
from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from ..report import MLFLOW_WAIT_S, RUN_ID, IncompleteRunDir, NoSpikeEvents, ReportSource, ReportSourceError, \
    not_a_run_dir, resolve_source
from ..artifacts.table_store import PART, UNREADABLE, load_table, merge_tables, parse_table, part_files
from ..run_dirs import find_run_dirs, run_dir_of
from ..trackers.bounded import CallTimeout, bounded_call
from ..trackers.naming import DETECTION_OFF, TABLE_KEY
from .rows import checked_rows, rows_ok


@dataclass
class RunTable:
    """One run's culprit table (``{"columns", "data"}``), its identity, and how to name it."""

    name: str
    run_id: str
    table: dict[str, Any]
    aliases: tuple[str, ...] = ()  # the run's other identities (a run dir's other backend run: ``run_keys``)


def _table(src: ReportSource) -> tuple[dict[str, Any], int, int]:
    """The run's culprit table, its rows checked: its parts (run dir, MLflow download), or what the
    backend's reader holds (a W&B run's cumulative table, a TensorBoard run's parts); and how many parts
    it has and how many of them could not be read (``table_store.UNREADABLE``)."""
    if src.reader is not None:
        parts = [(name, parse_table(data, name, src.notes)) for name, data in src.reader.tables("tokens")]
        merged = merge_tables(checked_rows(t, name, src.notes) for name, t in parts)
        return _stepped(merged, src), len(parts), sum(bool(t.get(UNREADABLE)) for _, t in parts)
    files = [(p, _step_of_part(load_table(p, src.notes), p)) for p in part_files(src.root, TABLE_KEY)]
    bad = sum(bool(t.get(UNREADABLE)) for _, t in files)
    merged = merge_tables(t for _, t in files)
    if not rows_ok(merged):  # (the common case passes: one check per run) else part by part, each note its file
        merged = merge_tables(checked_rows(t, os.path.relpath(p, src.root), src.notes) for p, t in files)
    return _stepped(merged, src), len(files), bad


def _step_of_part(table: dict[str, Any], path: str) -> dict[str, Any]:
    """A part without a ``step`` column (a hand-made table) gets its file's step (``step_000100.json``): one spike
    event a part, as the writer's parts are (held-out tester, stop 63: two such parts merged into one event)."""
    if "step" in table["columns"] or not table["data"] or not (m := PART.fullmatch(os.path.basename(path))):
        return table
    return {**table, "columns": [*table["columns"], "step"], "data": [[*r, int(m.group(1))] for r in table["data"]]}


def _stepped(table: dict[str, Any], src: ReportSource) -> dict[str, Any]:
    """``table``; a note when its rows have no step to tell its spike events apart (they count as one)."""
    if table["data"] and "step" not in table["columns"]:
        src.notes.append(f"its culprit table has no step column: its {len(table['data'])} row(s) count as one "
                         "spike event")  # (read_run names the run)
    return table


def read_run(source: str, tracking_uri: str | None, notes: list[str],
             incomplete: list[str] | None = None) -> RunTable | None:
    """One run (dir, W&B dir or MLflow run id); None (and a note) when it logged no spike event. A run
    dir some of whose writes failed (``INCOMPLETE``) is a note too, and goes into ``incomplete``."""
    try:
        src = resolve_source(source, tracking_uri)
    except IncompleteRunDir as exc:
        notes.append(str(exc))
        if incomplete is not None:
            incomplete.append(str(exc))
        return None
    except NoSpikeEvents as exc:  # (a run without a spike detector: said so, not as a clean run)
        notes.append(f"{source}: {DETECTION_OFF if DETECTION_OFF in str(exc) else 'no spike events'}")
        return None
    if src.incomplete is not None:
        notes.append(src.incomplete)
        if incomplete is not None:
            incomplete.append(src.incomplete)
    try:
        table, n_parts, unreadable = _table(src)
    finally:
        if src.temporary:
            shutil.rmtree(src.root, ignore_errors=True)
    notes.extend(f"{src.title}: {n}" for n in src.notes)
    if not n_parts:  # events, none with culprits (locate.enabled=false, or each said why not): no table to add
        notes.append(f"{src.title}: its spike events have no culprit table (none was localized: locate.enabled="
                     "false, or each event's console block says why not)")
        return None
    if unreadable:  # its culprits cannot be read: no ledger may read as "nothing blamed" (held-out tester, stop 54)
        why = (f"{src.title}: {unreadable} of its {n_parts} culprit table part(s) could not be read (the notes "
               "above)")
        if incomplete is not None:
            incomplete.append(why)
        if unreadable == n_parts:
            notes.append(f"{why}: the run is left out")
            return None
    return RunTable(src.title, src.run_id, table, tuple(src.aliases))


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
    if not runs:
        raise ReportSourceError(f"MLflow experiment {name!r} in {uri} has no runs")
    return runs


def runs_of(source: str, tracking_uri: str | None) -> list[str]:
    """The runs ``source`` names: itself (a run dir, its ``spikes/``, a W&B run folder, an MLflow run
    id), the run dirs under a folder, or an experiment's runs. ``ReportSourceError`` when there is none."""
    path = Path(source)
    if path.is_dir():
        if run_dir_of(path) is not None:
            return [source]
        found = find_run_dirs(path)
        if not found:
            raise ReportSourceError(not_a_run_dir(path))
        return [str(p) for p in found]
    if RUN_ID.match(source) or os.sep in source or source.startswith("."):
        return [source]  # a run id, or a path that is not there (resolve_source says so)
    return experiment_runs(source, tracking_uri)


def read_runs(sources: Iterable[str], tracking_uri: str | None = None,
              notes: list[str] | None = None, incomplete: list[str] | None = None) -> list[RunTable]:
    """Every run named by ``sources`` (run dirs and folders of them, W&B run dirs, MLflow run ids or
    experiment names), each once, with names that tell them apart; ``incomplete`` receives why a run
    dir is not the whole run (some of its writes failed)."""
    notes = notes if notes is not None else []
    out: list[RunTable] = []
    seen: set[str] = set()  # every identity of the runs read (``RunTable.aliases``)
    read: set[str] = set()  # the ids they were read by
    for source in sources:
        for run in runs_of(str(source), tracking_uri):
            got = read_run(run, tracking_uri, notes, incomplete)
            if got is None:
                continue
            keys = {got.run_id, *got.aliases}
            if keys & seen:  # a run named twice counts once: by the same id, or by another of its backend runs
                if got.run_id not in read:
                    notes.append(f"{got.name}: the same run as one read before (another of its tracker runs: "
                                 "tracker=both); counted once")
            else:
                out.append(got)
                read.add(got.run_id)
            seen |= keys
    tell_apart(out)
    return out


def tell_apart(runs: list[RunTable]) -> None:
    """Runs that share a name get names that differ: a run dir its path from where they part
    (``sweepA/0_clip=adagc``), a tracker's run ``name#<id>`` (as few id characters as tell them apart)."""
    by_name: dict[str, list[RunTable]] = {}
    for r in runs:
        by_name.setdefault(r.name, []).append(r)
    for same in (group for group in by_name.values() if len(group) > 1):
        dirs = [r for r in same if r.run_id.startswith(os.sep)]
        for r, label in zip(dirs, _path_labels([r.run_id for r in dirs])):
            r.name = label
        others = [r for r in same if not r.run_id.startswith(os.sep)]
        for n in (8, 12, 16, 64):
            labels = [f"{r.name}#{r.run_id.removeprefix('wandb:')[:n]}" for r in others]
            if len(set(labels)) == len(labels):
                break
        for r, label in zip(others, labels):
            r.name = label


def _path_labels(paths: list[str]) -> list[str]:
    """The shortest trailing parts of each path (two at least) that no two paths share."""
    parts = [Path(p).parts for p in paths]
    for k in range(2, max(map(len, parts), default=0) + 1):
        labels = ["/".join(p[-k:]) for p in parts]
        if len(set(labels)) == len(labels):
            return labels
    return paths
