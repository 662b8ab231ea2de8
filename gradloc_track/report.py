"""One standalone HTML page with every spike event of a run, for people on neither W&B nor MLflow.

Reads the shared file layout (``spikes/tokens.json``, ``spikes/highlight/step_*.html``,
``spikes/heatmap/step_*.png``, see ``trackers/base.py``) from a local run directory, or downloads
it from an MLflow run first. Event pages (whole documents) are embedded as sandboxed
``<iframe srcdoc>`` with the document escaped into the attribute; images as base64 data URIs. The
page has no script and loads nothing from outside.
"""
from __future__ import annotations

import base64
import html
import re
import tempfile
from pathlib import Path

from .artifacts.highlight import visible
from .artifacts.table_store import read_table

STEP = re.compile(r"step_(\d+)\.(html|png)$")
CSS = ("body{font-family:system-ui,sans-serif;margin:16px} table{border-collapse:collapse;font-size:12px}"
       "td,th{border:1px solid #ccc;padding:2px 5px} iframe{width:100%;height:480px;border:1px solid #ddd}"
       "img{max-width:100%} td.tok{font-family:ui-monospace,Menlo,Consolas,monospace;white-space:pre}")
CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:"


class ReportSourceError(FileNotFoundError):
    """The report source is neither a run directory with ``spikes/`` nor a readable MLflow run."""


def _fetch_mlflow(run_id: str, tracking_uri: str | None) -> Path:
    """Download the run's ``spikes/`` artifacts into a temp dir; the dir that holds ``spikes/``."""
    from ._optional import require

    require("mlflow", "mlflow")
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from .trackers.mlflow_tracker import resolve_tracking_uri

    uri = resolve_tracking_uri(tracking_uri)
    client = MlflowClient(uri)
    try:
        client.get_run(run_id)
    except MlflowException as exc:
        raise ReportSourceError(
            f"{run_id!r} is neither a run directory nor a run in the MLflow store {uri} ({exc.message.splitlines()[0]}); "
            "pass a local run directory, or an MLflow run id with --tracking-uri pointing at its store") from exc
    dst = Path(tempfile.mkdtemp(prefix="gradloc-report-"))
    try:
        client.download_artifacts(run_id, "spikes", str(dst))
    except (MlflowException, OSError) as exc:
        raise ReportSourceError(f"MLflow run {run_id} has no spikes/ artifacts: it logged no spike events") from exc
    return dst


def _by_step(folder: Path, ext: str) -> dict[int, Path]:
    out = {}
    for p in sorted(folder.glob(f"step_*.{ext}")) if folder.is_dir() else []:
        m = STEP.search(p.name)
        if m:
            out[int(m.group(1))] = p
    return out


def _table(table: dict) -> str:
    cols, data = table.get("columns", []), table.get("data", [])
    if not cols:
        return ""
    tok = cols.index("token") if "token" in cols else -1
    esc = html.escape
    head = "".join(f"<th>{esc(str(c))}</th>" for c in cols)
    body = "".join(
        "<tr>" + "".join(f"<td class='tok'>{visible(str(v))}</td>" if i == tok else
                         f"<td>{esc(f'{v:.4g}' if isinstance(v, float) else str(v))}</td>"
                         for i, v in enumerate(r)) + "</tr>"
        for r in data)
    return f"<h2>All culprit tokens</h2><table><tr>{head}</tr>{body}</table>"


def build_report(source: str | Path, tracking_uri: str | None = None) -> str:
    """The report page for a run directory, or for an MLflow run id when ``source`` is no directory."""
    root = Path(source)
    if not root.is_dir():
        root = _fetch_mlflow(str(source), tracking_uri)
    spikes = root / "spikes"
    if not spikes.is_dir():
        raise ReportSourceError(f"{source}: no spikes/ folder in this run directory; it logged no spike events "
                                "(or pass the run directory the tracker wrote, the one holding spikes/)")
    table = read_table(root, "spikes/tokens")  # the per-event parts (or an older run's tokens.json)
    pages = _by_step(spikes / "highlight", "html")
    images = _by_step(spikes / "heatmap", "png")
    steps = sorted(set(pages) | set(images))
    esc = html.escape
    parts = [f"<h1>Spike report: {esc(str(source))}</h1>",
             f"<p>{len(steps)} spike event(s) (steps {esc(', '.join(map(str, steps))) or 'none'}), "
             f"{len(table.get('data', []))} culprit token(s).</p>", _table(table)]
    for step in steps:
        parts.append(f"<h2 id='step-{step}'>step {step}</h2>")
        if step in pages:
            doc = pages[step].read_text(encoding="utf-8")
            # a whole document: escaped into srcdoc, sandboxed (no scripts even if one slipped in)
            parts.append(f"<iframe sandbox title=\"spike at step {step}\" srcdoc=\"{esc(doc, quote=True)}\"></iframe>")
        if step in images:
            data = base64.b64encode(images[step].read_bytes()).decode("ascii")
            parts.append(f"<img alt=\"per-layer heatmap, step {step}\" src=\"data:image/png;base64,{data}\">")
    return ("<!DOCTYPE html><html><head><meta charset='utf-8'>"
            f"<meta http-equiv='Content-Security-Policy' content=\"{CSP}\">"
            f"<title>gradloc-track spike report</title><style>{CSS}</style></head><body>{''.join(parts)}</body></html>")
