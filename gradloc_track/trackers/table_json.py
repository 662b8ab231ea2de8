"""A table part as strict JSON: a non-finite number (a NaN step's grad norm, an infinite z-score) is written as
the string ``"NaN"``, ``"Infinity"`` or ``"-Infinity"``, its cell listed under the part's ``"nonfinite"`` key,
and read back as the float.

Python's ``json`` writes bare ``NaN`` / ``Infinity``, which no strict parser takes (JavaScript's ``JSON.parse``,
MLflow's artifact viewer, ``jq``): the part of exactly the step a person most wants to read failed to open
(held-out tester round 8). Only the cells the part lists are turned back into floats, so text that reads "NaN"
(a token, a user's column) stays text.
"""
from __future__ import annotations

import json
import math
from typing import Any, Sequence

NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
CELLS = "nonfinite"  # the part's key listing [row, column] of each cell written as one of NONFINITE's strings


def _name(v: float) -> str:
    return "NaN" if v != v else ("Infinity" if v > 0 else "-Infinity")


def dumps_strict(doc: Any) -> str:
    """Any JSON document as strict JSON, a non-finite number written as its name (``"NaN"``): the ledger's
    ``culprits.json`` (a NaN reward in a sample's metadata, an overflowing share; held-out tester, stop 63). The
    common case, every number finite, is one pass of the C encoder."""
    try:
        return json.dumps(doc, default=str, allow_nan=False)
    except ValueError:
        return json.dumps(_named(doc), default=str, allow_nan=False)


def _named(v: Any) -> Any:
    if isinstance(v, float):
        return v if math.isfinite(v) else _name(v)
    if isinstance(v, dict):
        return {k: _named(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_named(x) for x in v]
    return v


def dumps_table(columns: Sequence[Any], rows: Sequence[Sequence[Any]]) -> str:
    """``{"columns": [...], "data": [[...]]}`` as strict JSON (anything else not JSON: its ``str``)."""
    data, cells = [], []
    for i, r in enumerate(rows):
        row = list(r)
        for j, v in enumerate(row):
            if isinstance(v, float) and not math.isfinite(v):
                row[j] = _name(v)
                cells.append([i, j])
        data.append(row)
    part = {"columns": list(columns), "data": data}
    if cells:
        part[CELLS] = cells
    return json.dumps(part, default=str, allow_nan=False)


def restore_nonfinite(table: dict[str, Any]) -> dict[str, Any]:
    """``table`` (as read) with the cells its ``"nonfinite"`` key lists back as floats, in place (the key is
    dropped: a merged table's row numbers are not the part's)."""
    cells = table.pop(CELLS, None)
    rows = table.get("data")
    if not isinstance(cells, list) or not isinstance(rows, list):
        return table
    for cell in cells:
        if not (isinstance(cell, list) and len(cell) == 2 and all(isinstance(k, int) for k in cell)):
            continue
        i, j = cell
        if 0 <= i < len(rows) and isinstance(rows[i], list) and 0 <= j < len(rows[i]):
            v = rows[i][j]
            if isinstance(v, str) and v in NONFINITE:
                rows[i][j] = NONFINITE[v]
    return table
