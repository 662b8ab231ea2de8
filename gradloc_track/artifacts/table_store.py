"""Read an attribution table back from the files a tracker wrote (local run dir or MLflow download).

Trackers append a table as one part per event, ``<key>/step_<step:06d>.json`` (never rewritten,
see ``trackers/interface.py``); runs from before that hold one ``<key>.json``. ``read_table`` joins
both, in step order, and skips (with a warning) a part it cannot read instead of failing.
"""
from __future__ import annotations

import json
import os
import re
import warnings
from pathlib import Path
from typing import Any, Iterable

from ..trackers.table_json import restore_nonfinite
from .keys import TABLE_KEY

PART = re.compile(r"step_(\d+)\.json")  # fullmatch


def _load(path: Path) -> dict[str, Any] | None:
    try:
        table = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:  # (nested 200k deep: no table)
        warnings.warn(f"gradloc-track: skipping unreadable table file {path} ({exc})", RuntimeWarning)
        return None
    if not (isinstance(table, dict) and isinstance(table.get("columns"), list)
            and isinstance(table.get("data"), list) and all(isinstance(r, list) for r in table["data"])):
        warnings.warn(f"gradloc-track: skipping {path}: not a {{\"columns\": [...], \"data\": [[...]]}} table",
                      RuntimeWarning)
        return None
    return restore_nonfinite(table)


def part_files(root: str | Path, key: str) -> list[str]:
    """``table_parts`` as plain paths: a 1000-run ledger lists 20,000 parts, and a glob or a ``Path``
    per part was most of its time."""
    legacy = os.path.join(root, f"{key}.json")
    folder = os.path.join(root, key)
    try:
        with os.scandir(folder) as entries:
            steps = [(int(m.group(1)), e.name) for e in entries if (m := PART.fullmatch(e.name))]
    except (FileNotFoundError, NotADirectoryError):
        steps = []
    return ([legacy] if os.path.isfile(legacy) else []) + [os.path.join(folder, name) for _, name in sorted(steps)]


def table_parts(root: str | Path, key: str) -> list[Path]:
    """The part files of table ``key`` under ``root``, in step order (the legacy file first)."""
    return [Path(p) for p in part_files(root, key)]


def read_table(root: str | Path, key: str = TABLE_KEY) -> dict[str, Any]:
    """``{"columns": [...], "data": [[...], ...]}``: every row of table ``key`` under ``root``."""
    return merge_tables(t for t in map(_load, table_parts(root, key)) if t is not None)


def merge_tables(tables: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """One table from several parts, in order. Columns are the first part's, then each column a later part
    brings (a run resumed with a newer version: its ``data_fault``, a ``rank`` first seen later; review, stop
    56: they were dropped), ``None`` in the rows before it; rows of a part with other columns are mapped by
    name (missing cells ``None``)."""
    columns: list[str] = []
    data: list[list[Any]] = []
    for table in tables:
        if not table.get("columns"):
            continue
        cols = table["columns"]
        if cols == columns:  # the common case: one comparison a part
            data.extend(table["data"])
            continue
        cols = [str(c) for c in cols]
        seen = set(columns)
        new = [c for c in cols if c not in seen]
        if new:
            if columns:
                data = [r + [None] * len(new) for r in data]
            columns = columns + new
        if cols == columns:
            data.extend(table["data"])
        else:
            index = {c: i for i, c in enumerate(cols)}
            data.extend([[r[index[c]] if c in index and index[c] < len(r) else None for c in columns]
                         for r in table["data"]])
    return {"columns": columns, "data": data}
