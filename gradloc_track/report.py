"""One standalone HTML page with every spike event of a run, for people on neither W&B nor MLflow.

Reads the shared file layout (``spikes/tokens.json``, ``spikes/highlight/step_*.html``,
``spikes/heatmap/step_*.png``) from a local run directory, or downloads it from an MLflow run.
Event pages are embedded as sandboxed ``<iframe srcdoc>`` (escaped), images as data URIs: no
script, no external resource.
"""
from __future__ import annotations

import base64
import html
import json
import re
import tempfile
from pathlib import Path

STEP = re.compile(r"step_(\d+)\.(html|png)$")


def _fetch_mlflow(run_id: str, tracking_uri: str | None) -> Path:
    from ._optional import require

    require("mlflow", "mlflow")
    from mlflow.tracking import MlflowClient

    from .trackers.mlflow_tracker import resolve_tracking_uri

    client = MlflowClient(resolve_tracking_uri(tracking_uri))
    dst = Path(tempfile.mkdtemp(prefix="gradloc-report-"))
    client.download_artifacts(run_id, "spikes", str(dst))
    return dst


def _by_step(folder: Path, ext: str) -> dict[int, Path]:
    out = {}
    for p in sorted(folder.glob(f"step_*.{ext}")) if folder.exists() else []:
        m = STEP.search(p.name)
        if m:
            out[int(m.group(1))] = p
    return out


def build_report(source: str, tracking_uri: str | None = None) -> str:
    """The report page for a run directory, or an MLflow run id when ``source`` is no directory."""
    root = Path(source)
    if not root.is_dir():
        root = _fetch_mlflow(source, tracking_uri)
    spikes = root / "spikes"
    if not spikes.exists():
        raise FileNotFoundError(f"{source}: no spikes/ folder — this run logged no spike events")
    table = json.loads((spikes / "tokens.json").read_text()) if (spikes / "tokens.json").exists() else \
        {"columns": [], "data": []}
    pages = _by_step(spikes / "highlight", "html")
    images = _by_step(spikes / "heatmap", "png")
    esc = html.escape
    cols = table["columns"]
    parts = [f"<h1>Spike report: {esc(str(source))}</h1>",
             f"<p>{len(pages)} spike event(s), {len(table['data'])} culprit token(s).</p>"]
    if cols:
        head = "".join(f"<th>{esc(c)}</th>" for c in cols)
        rows = "".join("<tr>" + "".join(f"<td>{esc(str(v))}</td>" for v in r) + "</tr>" for r in table["data"])
        parts.append(f"<h2>All culprit tokens</h2><table><tr>{head}</tr>{rows}</table>")
    for step in sorted(set(pages) | set(images)):
        parts.append(f"<h2>step {step}</h2>")
        if step in pages:
            doc = pages[step].read_text(encoding="utf-8")
            parts.append(f"<iframe sandbox title='step {step}' srcdoc=\"{esc(doc, quote=True)}\"></iframe>")
        if step in images:
            data = base64.b64encode(images[step].read_bytes()).decode()
            parts.append(f"<img alt='per-layer heatmap, step {step}' src='data:image/png;base64,{data}'>")
    css = ("body{font-family:system-ui,sans-serif;margin:16px} table{border-collapse:collapse;font-size:12px}"
           "td,th{border:1px solid #ccc;padding:2px 5px} iframe{width:100%;height:420px;border:1px solid #ddd}"
           "img{max-width:100%}")
    return ("<!DOCTYPE html><html><head><meta charset='utf-8'>"
            "<meta http-equiv='Content-Security-Policy' content=\"default-src 'none'; style-src 'unsafe-inline'; "
            "img-src data:; frame-src 'self'\">"
            f"<title>gradloc-track report</title><style>{css}</style></head><body>{''.join(parts)}</body></html>")
