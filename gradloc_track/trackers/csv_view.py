"""A table part as CSV: the form MLflow's artifact viewer shows as a table.

MLflow's UI shows a ``.json`` artifact as raw JSON, but renders ``.csv``/``.tsv`` artifacts as a
sortable table (its artifact page picks the table view by file extension, header row first). The
MLflow tracker uploads this view next to each JSON part; the JSON part stays the record that
``read_table`` and the report read (CSV would lose the cells' types).
"""
from __future__ import annotations

import csv
import io
import json
import math
from typing import Any, Sequence


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6g}" if math.isfinite(value) else str(value)
    if isinstance(value, (list, tuple, dict)):
        return json.dumps(value, default=str)
    return str(value)


def csv_text(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Header row, then one line per row (fields quoted where they hold commas, quotes or newlines)."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow([str(c) for c in columns])
    writer.writerows([_cell(v) for v in row] for row in rows)
    return out.getvalue()
