"""The ledger as files: CSV (one per view), JSON (both views) and one HTML page.

The page is built like the spike report's: every cell escaped, the report's Content-Security-Policy
(no script may run, nothing is loaded from outside).
"""
from __future__ import annotations

import csv
import html
import io
import json
from pathlib import Path
from typing import Any, Sequence

from ..report import CSP, CSS
from .aggregate import Ledger

LIST_SEP = "; "
PAGE_CSS = CSS + " td.text{font-family:ui-monospace,Menlo,Consolas,monospace;white-space:pre-wrap;max-width:60ch}"


def _cell(v: Any) -> Any:
    """A flat cell: lists joined, floats kept."""
    return LIST_SEP.join(map(str, v)) if isinstance(v, list) else v


def columns_of(entries: Sequence[dict]) -> list[str]:
    cols: list[str] = []
    for e in entries:
        cols += [k for k in e if k not in cols]
    return cols


def as_rows(entries: Sequence[dict]) -> tuple[list[str], list[list[Any]]]:
    """(columns, rows) of a view, lists flattened (the form of a tracker table)."""
    cols = columns_of(entries)
    return cols, [[_cell(e.get(c)) for c in cols] for e in entries]


def to_csv(entries: Sequence[dict]) -> str:
    cols, rows = as_rows(entries)
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(cols)
    writer.writerows(rows)
    return buf.getvalue()


def to_json(ledger: Ledger, samples: list[dict], groups: list[dict] | None, by: str | None) -> str:
    doc = {"format": "gradloc-track-culprit-ledger", "version": 1, "runs": ledger.runs, "spike_events": ledger.events,
           "metadata_columns": ledger.metadata, "samples": samples, "notes": ledger.notes}
    if by is not None:
        doc.update(by=by, groups=groups)
    return json.dumps(doc, indent=1, default=str)


def _html_table(title: str, entries: Sequence[dict], text_cols: tuple[str, ...] = ("text",)) -> str:
    esc = html.escape
    cols, rows = as_rows(entries)
    if not cols:
        return f"<h2>{esc(title)}</h2><p>none</p>"
    head = "".join(f"<th>{esc(str(c))}</th>" for c in cols)
    body = "".join("<tr>" + "".join(
        f"<td class='text'>{esc(str(v))}</td>" if c in text_cols else
        f"<td>{esc(f'{v:.4g}' if isinstance(v, float) else '' if v is None else str(v))}</td>"
        for c, v in zip(cols, r)) + "</tr>" for r in rows)
    return f"<h2>{esc(title)}</h2><table><tr>{head}</tr>{body}</table>"


def to_html(ledger: Ledger, samples: list[dict], groups: list[dict] | None, by: str | None) -> str:
    esc = html.escape
    parts = ["<h1>Culprit ledger</h1>",
             f"<p>{len(ledger.runs)} run(s) ({esc(', '.join(ledger.runs)) or 'none'}), {ledger.events} spike "
             f"event(s) with culprits, {len(samples)} blamed sample(s).</p>"]
    parts += [f"<p class='note'>{esc(n)}</p>" for n in ledger.notes]
    if by is not None:
        parts.append(_html_table(f"By {by}", groups or [], ("summary",) + (("token",) if by == "token" else ())))
    parts.append(_html_table("Blamed samples", samples))
    return ("<!DOCTYPE html><html><head><meta charset='utf-8'>"
            f"<meta http-equiv='Content-Security-Policy' content=\"{CSP}\">"
            f"<title>gradloc-track culprit ledger</title><style>{PAGE_CSS}</style></head>"
            f"<body>{''.join(parts)}</body></html>")


def write_files(out_dir: str | Path, ledger: Ledger, samples: list[dict], groups: list[dict] | None,
                by: str | None) -> list[Path]:
    """``culprits.csv``, ``culprits.json``, ``culprits.html`` (and ``culprits_by_<by>.csv``) in ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = {"culprits.csv": to_csv(samples), "culprits.json": to_json(ledger, samples, groups, by),
             "culprits.html": to_html(ledger, samples, groups, by)}
    if by is not None:
        files[f"culprits_by_{_safe(by)}.csv"] = to_csv(groups or [])
    for name, text in files.items():
        (out / name).write_text(text, encoding="utf-8")
    return [out / n for n in files]


def _safe(name: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in name)
