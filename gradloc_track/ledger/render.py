"""The ledger as files: CSV (one per view), JSON (both views) and one HTML page.

The page is built like the spike report's: every cell shown visibly (``text.visible_html``: bidi
controls and NUL as escapes) and escaped, the report's Content-Security-Policy (no script may run,
nothing is loaded from outside), long text wrapped inside its column (CSS only). CSV cells go
through ``text.csv_cell`` (a cell a spreadsheet would evaluate is defused); the JSON keeps the exact
text. Every file is written atomically (``trackers.files``).
"""
from __future__ import annotations

import csv
import html
import io
from operator import methodcaller
from pathlib import Path
from typing import Any, Sequence

from ..report import CSP, CSS, cell_text
from ..text import FORMULA_START, csv_cell, visible_html, visible_text
from ..trackers.files import atomic_write_text
from ..trackers.table_json import dumps_strict
from .aggregate import Views, group_columns

LIST_SEP = "; "
NUMBERS = {int, float, bool}  # cells a CSV takes as they are (``csv_cell``)
MAX_PAGE_ROWS = 1000  # rows of a table on the page (a person reads the top; the CSV and JSON hold every one)
MAX_PAGE_RUNS = 20  # run names in the page's header
# text may break anywhere (a 200-character excerpt without a space, a run path, a list of steps),
# so the table's narrowest layout fits any window and it never grows past it, nor does a line of
# the header; the text column keeps a readable width
PAGE_CSS = CSS + (" body{overflow-wrap:anywhere} table{max-width:100%} td,th{vertical-align:top}"
                  " td.text{font-family:ui-monospace,Menlo,Consolas,monospace;white-space:pre-wrap;min-width:24ch}")


def _cell(v: Any) -> Any:
    """A flat cell: lists joined, floats kept."""
    return LIST_SEP.join(map(str, v)) if isinstance(v, list) else v


def columns_of(entries: Sequence[dict]) -> list[str]:
    """Every key of the entries, in first-seen order."""
    return list(dict.fromkeys(k for e in entries for k in e))


def as_rows(entries: Sequence[dict]) -> tuple[list[str], list[list[Any]]]:
    """(columns, rows) of a view, lists flattened (the form of a tracker table)."""
    cols = columns_of(entries)
    return cols, [[_cell(e.get(c)) for c in cols] for e in entries]


def to_csv(entries: Sequence[dict], columns: Sequence[str] = ()) -> str:
    """The entries as CSV; ``columns``: the header when there is no entry to take it from."""
    cols = columns_of(entries) or list(columns)
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow([csv_cell(c) for c in cols])
    writer.writerows(zip(*(_csv_column([e.get(c) for e in entries]) for c in cols)) if cols else ([] for _ in entries))
    return buf.getvalue()


_FORMULA = methodcaller("startswith", FORMULA_START)


def _csv_column(values: list[Any]) -> list[Any]:
    """One column's CSV cells (``csv_cell`` of each); a column of numbers, or of printable text that starts no
    formula, as it is, each test at C speed over the column (20,002 samples x 8 columns in a 1000-run ledger)."""
    kinds = set(map(type, values))
    if list in kinds:  # a sample's runs and steps: joined first
        values = [LIST_SEP.join(map(str, v)) if type(v) is list else v for v in values]
        kinds = set(map(type, values))
    if kinds <= NUMBERS:
        return values
    text = values if kinds == {str} else [v for v in values if type(v) is str]
    if kinds <= NUMBERS | {str} and all(map(str.isprintable, text)) and not any(map(_FORMULA, text)):
        return values
    return [csv_cell(_cell(v)) for v in values]


def to_json(v: Views) -> str:
    led = v.ledger
    doc = {"format": "gradloc-track-culprit-ledger", "version": 1, "runs": led.runs, "run_ids": led.run_ids,
           "spike_events": led.events, "metadata_columns": led.metadata, "samples": v.samples, "notes": led.notes}
    if v.by is not None:
        doc.update(by=v.by, groups=v.groups)
    return dumps_strict(doc)  # no indent: the C encoder (indent runs the pure-python one, ~5x slower)


def _html_table(title: str, entries: Sequence[dict], text_cols: tuple[str, ...] = ("text",)) -> str:
    cols, rows = as_rows(entries[:MAX_PAGE_ROWS])
    if not cols:
        return f"<h2>{html.escape(title)}</h2><p>none</p>"
    if len(entries) > MAX_PAGE_ROWS:
        title += f" (the first {MAX_PAGE_ROWS} of {len(entries)}; every one is in the CSV and the JSON)"
    head = "".join(f"<th>{cell_text(c)}</th>" for c in cols)
    body = "".join("<tr>" + "".join(
        f"<td class='text'>{_text_html(v)}</td>" if c in text_cols else f"<td>{cell_text(v)}</td>"
        for c, v in zip(cols, r)) + "</tr>" for r in rows)
    return f"<h2>{html.escape(title)}</h2><table><tr>{head}</tr>{body}</table>"


def _text_html(v: Any) -> str:
    return visible_html("" if v is None else str(v), empty="")


def to_html(v: Views) -> str:
    led, esc = v.ledger, html.escape
    more = f" and {len(led.runs) - MAX_PAGE_RUNS} more" if len(led.runs) > MAX_PAGE_RUNS else ""
    runs = esc(visible_text(", ".join(led.runs[:MAX_PAGE_RUNS]) + more)) or "none"
    parts = ["<h1>Culprit ledger</h1>",
             f"<p>{len(led.runs)} run(s) ({runs}), {led.events} spike event(s) with culprits, "
             f"{len(v.samples)} blamed sample(s).</p>"]
    parts += [f"<p class='note'>{esc(visible_text(n))}</p>" for n in led.notes]
    if v.by is not None:
        parts.append(_html_table(f"By {v.by}", v.groups or [], ("summary",) + (("token",) if v.by == "token" else ())))
    parts.append(_html_table("Blamed samples", v.samples))
    return ("<!DOCTYPE html><html><head><meta charset='utf-8'>"
            f"<meta http-equiv='Content-Security-Policy' content=\"{CSP}\">"
            f"<title>gradloc-track culprit ledger</title><style>{PAGE_CSS}</style></head>"
            f"<body>{''.join(parts)}</body></html>")


def write_files(out_dir: str | Path, v: Views) -> list[Path]:
    """``culprits.csv``, ``culprits.json``, ``culprits.html`` (and ``culprits_by_<by>.csv``) in ``out_dir``."""
    out = Path(out_dir)
    files = {"culprits.csv": to_csv(v.samples), "culprits.json": to_json(v), "culprits.html": to_html(v)}
    if v.by is not None:
        files[f"culprits_by_{_safe(v.by)}.csv"] = to_csv(v.groups or [], group_columns(v.by))
    for name, text in files.items():
        atomic_write_text(out / name, text)
    return [out / n for n in files]


def _safe(name: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in name)
