"""A table part as strict JSON: a non-finite number (a NaN step's grad norm, an infinite z-score) is written as
the string ``"NaN"``, ``"Infinity"`` or ``"-Infinity"`` and read back as the float.

Python's ``json`` writes bare ``NaN`` / ``Infinity``, which no strict parser takes (JavaScript's ``JSON.parse``,
MLflow's artifact viewer, ``jq``): the part of exactly the step a person most wants to read failed to open
(held-out tester round 8). Reading back, a cell is turned into the float only in a column that is not text: one
of the table's own numeric columns, or a user column whose other cells are numbers (a token whose text is "NaN"
stays text).
"""
from __future__ import annotations

import json
import math
from typing import Any, Sequence

NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}
TEXT_COLUMNS = frozenset({"token", "level", "top_layers", "signal", "sample_id", "text", "cause", "detail", "culprit",
                          "why_not", "source"})


def _cell(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return "NaN" if v != v else ("Infinity" if v > 0 else "-Infinity")
    return v


def dumps_table(columns: Sequence[Any], rows: Sequence[Sequence[Any]]) -> str:
    """``{"columns": [...], "data": [[...]]}`` as strict JSON (anything else not JSON: its ``str``)."""
    data = [[_cell(v) for v in r] for r in rows]
    return json.dumps({"columns": list(columns), "data": data}, default=str, allow_nan=False)


def restore_nonfinite(table: dict[str, Any]) -> dict[str, Any]:
    """``table`` (as read) with the non-finite numbers ``dumps_table`` wrote as strings back as floats, in place."""
    columns, rows = table.get("columns"), table.get("data")
    if not isinstance(columns, list) or not isinstance(rows, list):
        return table
    for j, name in enumerate(columns):
        if name in TEXT_COLUMNS:
            continue
        cells = [r[j] for r in rows if isinstance(r, list) and j < len(r)]
        marked = [v for v in cells if isinstance(v, str) and v in NONFINITE]
        if not marked:
            continue
        others = [v for v in cells if v is not None and not (isinstance(v, str) and v in NONFINITE)]
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in others):
            for r in rows:
                if isinstance(r, list) and j < len(r) and isinstance(r[j], str) and r[j] in NONFINITE:
                    r[j] = NONFINITE[r[j]]
    return table
