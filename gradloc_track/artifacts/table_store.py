"""Read an attribution table back from the files a tracker wrote (local run dir or MLflow download).

Trackers append a table as one part per event, ``<key>/step_<step:06d>.json`` (never rewritten,
see ``trackers/interface.py``); runs from before that hold one ``<key>.json``. ``load_table`` /
``parse_table`` read one part, and what they cannot read (the part, or rows of it) becomes a note, never a
traceback: the report and the ledger show the notes; ``read_table`` joins the parts, in step order, and warns.
"""
from __future__ import annotations

import json
import os
import re
import warnings
from pathlib import Path
from typing import Any, Iterable

from ..trackers.table_json import restore_nonfinite
from ..trackers.naming import TABLE_KEY

PART = re.compile(r"step_(\d+)\.json")  # fullmatch


def decode_text(data: bytes, name, notes: list[str]) -> str:
    """``data`` as text; ``name`` (or a function that makes it: only a note needs it) names it in the note."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        notes.append(f"{name() if callable(name) else name} is not valid UTF-8 (byte {exc.start}); undecodable bytes "
                     "are shown as \ufffd")
        return data.decode("utf-8", errors="replace")


UNREADABLE = "#unreadable"  # set on the empty table a part that could not be read stands for (``parse_table``)


def load_table(path: str | Path, notes: list[str]) -> dict:
    """``{"columns": [...], "data": [[...], ...]}`` from a table file; a readable note instead of a traceback,
    naming the file by its place in the run (``spikes/tokens/step_000003.json``: held-out tester, stop 54, two
    notes both said ``step_000003.json``, one an events and one a tokens file)."""
    with open(path, "rb") as f:
        data = f.read()
    # its last three parts, by string, and only for a note: a 1000-run ledger reads 20,000 parts
    return _parse(data, notes, lambda: "/".join(os.path.normpath(os.fspath(path)).split(os.sep)[-3:]))


def parse_table(data: bytes, name: str, notes: list[str]) -> dict:
    """``load_table`` of a table's bytes (a backend reader's part), ``name`` saying which in the notes."""
    return _parse(data, notes, lambda: name)


def _parse(data: bytes, notes: list[str], name_of) -> dict:
    empty = {"columns": [], "data": [], UNREADABLE: True}
    try:
        table = json.loads(decode_text(data, name_of, notes))
    except ValueError as exc:  # truncated (a write was cut short) or not JSON at all
        notes.append(f"{name_of()} is not valid JSON ({exc}); this part of its table is left out. "
                     "A truncated file usually means the run was killed while writing it")
        return empty
    except RecursionError:  # e.g. 200k nested lists: no table of ours
        notes.append(f"{name_of()} is nested too deeply to be a table; it is left out")
        return empty
    if not (isinstance(table, dict) and isinstance(table.get("columns"), list) and isinstance(table.get("data"), list)):
        notes.append(f"{name_of()} is not a table (expected an object with \"columns\" and \"data\" lists, "
                     f"got {type(table).__name__}); it is left out")
        return empty
    restore_nonfinite(table)  # by the part's own row numbers: before any row is left out
    cols, rows = table["columns"], table["data"]
    n = len(cols)
    # each check at C speed over the whole part, the common case (every row a list of n cells) copying nothing
    if rows and not (set(map(type, rows)) == {list} and set(map(len, rows)) == {n}):
        kept = [r for r in rows if isinstance(r, list) and len(r) == n]
        notes.append(f"{name_of()}: {len(rows) - len(kept)} row(s) without exactly {n} cells were left out")
        rows = kept
    if not set(map(type, cols)) <= {str}:
        cols = [str(c) for c in cols]
    return {"columns": cols, "data": rows}


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
    """``{"columns": [...], "data": [[...], ...]}``: every row of table ``key`` under ``root``; what could not be
    read (a part, or rows of one: ``load_table``'s notes) is left out with a ``RuntimeWarning`` naming it."""
    tables = []
    for path in part_files(root, key):
        notes: list[str] = []
        try:
            table = load_table(path, notes)
        except OSError as exc:
            table, notes = None, [f"{path} cannot be read ({exc.strerror or exc!r}); it is left out"]
        for note in notes:
            warnings.warn(f"gradloc-track: {note}", RuntimeWarning, stacklevel=2)
        if table is not None and not table.get(UNREADABLE):
            tables.append(table)
    return merge_tables(tables)


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
