"""A table part as CSV: the form MLflow's artifact viewer shows as a table.

MLflow's UI shows a ``.json`` artifact as raw JSON, but renders ``.csv``/``.tsv`` artifacts as a
sortable table (its artifact page picks the table view by file extension, header row first). The
MLflow tracker uploads this view next to each JSON part; the JSON part stays the record that
``read_table`` and the report read (CSV would lose the cells' types). Cells go through
``text.csv_cell`` like every CSV we write: text shown visibly, a cell a spreadsheet would evaluate
(``=``, ``+``, ``-``, ``@``...) defused with a leading ``'``, numbers kept as numbers (floats to 6
significant digits).
"""
from __future__ import annotations

import csv
import io
from typing import Any, Sequence

from ..text import csv_cell


def _cell(value: Any) -> Any:
    if isinstance(value, float):
        value = float(f"{value:.6g}")  # still a number: 6 digits are plenty to read, and no '-' defused
    return csv_cell(value)


def csv_text(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Header row, then one line per row (fields quoted where they hold commas or quotes)."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow([csv_cell(str(c)) for c in columns])
    writer.writerows([_cell(v) for v in row] for row in rows)
    return out.getvalue()
