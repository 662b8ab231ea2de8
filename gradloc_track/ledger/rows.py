"""The cells the ledger computes with, checked as each table file is read.

A culprit table is JSON a person can edit (or a disk can damage). A row whose ``share`` is
``"abc"``, whose step is no integer or whose position is a list would crash the sums and sorts
of ``aggregate``; such a row is left out instead, with one note per file naming the file, how
many rows and the first bad cell. The user's own columns are not checked: they are shown, not
computed with.
"""
from __future__ import annotations

import math
from typing import Any, Callable


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _opt(ok: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: v is None or ok(v)


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


#: column -> (the test a cell passes, what it must be)
CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "step": (_int, "an integer"),
    "share": (_opt(_finite), "a finite number"),
    "position": (_opt(_int), "an integer"),
    "end": (_opt(_int), "an integer"),
    "level": (_opt(lambda v: isinstance(v, str)), "a string"),
    "sample_id": (_opt(lambda v: isinstance(v, str)), "a string"),
}


def checked_rows(table: dict[str, Any], where: str, notes: list[str]) -> dict[str, Any]:
    """``table`` without the rows whose checked cells are not what the ledger computes with (a note
    naming ``where`` says how many and why the first one was left out)."""
    cols = table.get("columns", [])
    tests = [(cols.index(c), c, ok, what) for c, (ok, what) in CHECKS.items() if c in cols]
    keep, bad, first = [], 0, ""
    for i, row in enumerate(table.get("data", [])):
        wrong = next(((c, row[j], what) for j, c, ok, what in tests if not ok(row[j])), None)
        if wrong is None:
            keep.append(row)
            continue
        bad += 1
        if not first:
            c, v, what = wrong
            first = f"row {i}: {c}={v!r:.60} is not {what}"
    if bad:
        notes.append(f"{where}: {bad} row(s) left out ({first}; a hand-edited or damaged file?)")
    return {"columns": cols, "data": keep}
