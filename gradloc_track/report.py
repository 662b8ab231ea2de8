"""One standalone HTML page with every spike event of a run, for people on neither W&B nor MLflow.

Reads the shared file layout (``spikes/events/step_*.json``: every detected spike, localized or
not; ``spikes/tokens/step_*.json`` or an older ``spikes/tokens.json``,
``spikes/highlight/step_*.html``, ``spikes/heatmap/step_*.png``, see ``trackers/interface.py``) from a
local run directory, or downloads it from an MLflow run first. Event pages (whole documents) are embedded as sandboxed
``<iframe srcdoc>`` with the document escaped into the attribute; images as base64 data URIs. The
page has no script and loads nothing from outside.
"""
from __future__ import annotations

import base64
import html
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from .artifacts.table_store import merge_tables, table_parts
from .run_dirs import WHAT, find_run_dirs, run_dir_of, run_key, run_locations, wandb_run_id
from .text import token_html, visible_text
from .trackers.bounded import CallTimeout, bounded_call
from .trackers.incomplete import incomplete_reason
from .trackers.mlflow_links import mlflow_run_url

STEP = re.compile(r"step_(\d+)\.(html|png)$")
CSS = ("body{font-family:system-ui,sans-serif;margin:16px} table{border-collapse:collapse;font-size:12px}"
       "td,th{border:1px solid #ccc;padding:2px 5px} iframe{width:100%;height:480px;border:1px solid #ddd}"
       "img{max-width:100%} p.note{color:#a40} "
       "td.tok{font-family:ui-monospace,Menlo,Consolas,monospace;white-space:pre} .cut{color:#888}")
CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:"


class ReportSourceError(FileNotFoundError):
    """The report source is neither a run directory with ``spikes/`` nor a readable MLflow run."""


class NoSpikeEvents(ReportSourceError):
    """A run (dir, W&B folder or MLflow run) that exists and logged no spike event."""


class IncompleteRunDir(NoSpikeEvents):
    """A run dir marked ``INCOMPLETE`` (``trackers.incomplete``) that holds no spike files: its writes
    failed, so "no spike events" would be a guess."""


MLFLOW_WAIT_S = 20.0  # our bound on waiting for an MLflow store/server (its own retries take minutes)
RUN_ID = re.compile(r"^[0-9a-f]{32}$")
TITLE = re.compile(r"<title>spike at step (\d+)</title>")


@dataclass
class ReportSource:
    """Where a report's files are (the folder holding ``spikes/``), its title, and a link back to the run."""

    root: Path
    title: str
    link: str | None = None
    layout: str = "files"  # files (spikes/...) | wandb (files/media/...)
    notes: list[str] = field(default_factory=list)
    temporary: bool = False  # ``root`` is a download of ours: removed once the page is built
    run_id: str = ""  # which run it is (``run_dirs.run_key``): the MLflow run id, wandb:<id>, else the dir
    incomplete: str | None = None  # why the run dir is not the whole run (``trackers.incomplete``), if it is not


def _bounded(fn, what: str, timeout_s: float | None = None):
    """``fn()`` on a daemon thread; give up after ``timeout_s`` (MLflow's own retries can take minutes)."""
    timeout_s = MLFLOW_WAIT_S if timeout_s is None else timeout_s
    try:
        return bounded_call(fn, timeout_s, name="gradloc-report-mlflow")
    except CallTimeout:
        raise ReportSourceError(f"{what}: no answer within {timeout_s:.0f} s (server down or unreachable?); "
                                "check --tracking-uri, or pass the run directory instead") from None


def _fetch_mlflow(run_id: str, tracking_uri: str | None) -> ReportSource:
    """Download the run's ``spikes/`` artifacts into a temp dir."""
    from ._optional import require
    from .trackers.mlflow_tracker import resolve_tracking_uri

    uri = resolve_tracking_uri(tracking_uri)
    if uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///"):]).is_file():
        # MlflowClient would create an empty store here: say what is missing instead
        raise ReportSourceError(f"{run_id!r} is neither a run directory nor a run in an MLflow store: there is no "
                                f"store at {uri}; pass a run directory, or --tracking-uri pointing at the run's store")
    if uri.startswith(("http://", "https://")):
        _probe(uri)
    require("mlflow", "mlflow")
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    try:
        run = _bounded(lambda: client.get_run(run_id), f"MLflow at {uri}")
    except MlflowException as exc:
        raise ReportSourceError(
            f"{run_id!r} is neither a run directory nor a run in the MLflow store {uri} "
            f"({exc.message.splitlines()[0]}); "
            "pass a local run directory, or an MLflow run id with --tracking-uri pointing at its store") from exc
    dst = Path(tempfile.mkdtemp(prefix="gradloc-report-"))
    try:
        _bounded(lambda: client.download_artifacts(run_id, "spikes", str(dst)), f"MLflow at {uri}", 120.0)
    except (MlflowException, OSError) as exc:
        shutil.rmtree(dst, ignore_errors=True)
        raise NoSpikeEvents(f"MLflow run {run_id} has no spikes/ artifacts: it logged no spike events") from exc
    info = {"tracking_uri": uri, "experiment_id": run.info.experiment_id, "run_id": run_id}
    return ReportSource(dst, run.info.run_name or run_id, mlflow_run_url(info), temporary=True, run_id=run_id)


def _probe(uri: str, timeout_s: float = 5.0) -> None:
    """Fail fast on a server that is not there (connection refused / no route), before MLflow's retries."""
    import socket
    import urllib.parse

    u = urllib.parse.urlparse(uri)
    port = u.port or (443 if u.scheme == "https" else 80)
    try:
        socket.create_connection((u.hostname, port), timeout=timeout_s).close()
    except OSError as exc:
        raise ReportSourceError(f"MLflow server {uri} is unreachable ({exc}); start it, "
                                "or pass the run directory") from exc


def _wandb_files(folder: Path, run_id: str | None = None) -> Path | None:
    """The ``files/`` of a W&B run folder (``offline-run-*``/``run-*``), or of the one under ``folder``
    (``folder/wandb/*run-*``, ``folder/*run-*``) with this ``run_id`` (without one: the latest)."""
    if (folder / "files" / "media").is_dir():
        return folder / "files"
    runs = sorted(folder.glob("wandb/*run-*/files")) + sorted(folder.glob("*run-*/files"))
    runs = [r for r in runs if (r / "media").is_dir() and (run_id is None or r.parent.name.endswith(f"-{run_id}"))]
    return runs[-1] if runs else None


def not_a_run_dir(folder: Path) -> str:
    """What to say about a folder that is no run dir: the run dirs it holds, or what a run dir is."""
    found = find_run_dirs(folder)
    if not found:
        return f"{folder} is not a run dir and holds none; {WHAT}"
    listed = ", ".join(map(str, found[:3])) + (f" (+{len(found) - 3} more)" if len(found) > 3 else "")
    return f"{folder} is not a run dir; it holds {len(found)}: {listed}; pass one (culprits takes the whole folder)"


def _from_run_dir(run: Path, tracking_uri: str | None) -> ReportSource:
    """A run dir's files (its ``spikes/``, else the MLflow run or W&B files its run record names), with
    ``incomplete`` set when some of its writes failed."""
    incomplete = incomplete_reason(run)
    src = _sources_of(run, tracking_uri, incomplete)
    src.incomplete = incomplete
    return src


def _sources_of(run: Path, tracking_uri: str | None, incomplete: str | None) -> ReportSource:
    where = run_locations(run)
    if (run / "spikes").is_dir():
        m = where.get("mlflow") or {}
        return ReportSource(run, m.get("run_name") or run.name, mlflow_run_url(m) if m else None,
                            run_id=run_key(run, where))
    if "mlflow" in where:
        m = where["mlflow"]
        return _fetch_mlflow(m["run_id"], tracking_uri or m.get("tracking_uri"))
    w = where.get("wandb", {})
    wid = wandb_run_id(run, w)
    folders = ([Path(w["dir"])] if w.get("dir") else []) + [run]  # W&B's folder, else under (or is) the run dir
    files = next((f for f in (_wandb_files(d, wid) for d in folders) if f is not None), None)
    if files is not None:
        wid = wandb_run_id(files.parent, w)
        url = w.get("url") if not w.get("offline") else None
        return ReportSource(files, w.get("run_name") or files.parent.name, url, layout="wandb",
                            run_id=f"wandb:{wid}" if wid else str(files.parent.resolve()))
    backends = f" (its {' and '.join(where)} run has none either)" if where else ""
    if incomplete is not None:
        raise IncompleteRunDir(f"{incomplete}; it holds no spike files{backends}")
    raise NoSpikeEvents(f"{run}: a run dir with no spikes/ folder{backends}: it logged no spike events")


def resolve_source(source: str | Path, tracking_uri: str | None = None) -> ReportSource:
    """A run dir (any tracker: follows ``tracker/<backend>.json``; or its ``spikes/``), a W&B run folder,
    or an MLflow run id. ``ReportSourceError`` says what is wrong (``NoSpikeEvents``: a run without any)."""
    root = Path(source)
    if root.is_dir():
        run = run_dir_of(root)
        if run is None:
            raise ReportSourceError(not_a_run_dir(root))
        return _from_run_dir(run, tracking_uri)
    text = str(source)
    if not RUN_ID.match(text) and (os.sep in text or text.startswith(".") or root.suffix):
        raise ReportSourceError(f"{source}: no such run directory; pass the run directory the app printed "
                                "(runs/<date>/...), a W&B run directory, or an MLflow run id")
    return _fetch_mlflow(text, tracking_uri)


def _by_step(folder: Path, ext: str) -> dict[int, Path]:
    out = {}
    for p in sorted(folder.glob(f"step_*.{ext}")) if folder.is_dir() else []:
        m = STEP.search(p.name)
        if m:
            out[int(m.group(1))] = p
    return out


WANDB_MEDIA = re.compile(r"_(\d+)_[0-9a-f]+\.(?:html|png)$")


def _wandb_step(p: Path) -> int:
    m = WANDB_MEDIA.search(p.name)
    return int(m.group(1)) if m else -1


def _read_text(path: str | Path, notes: list[str]) -> str:
    with open(path, "rb") as f:
        data = f.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        notes.append(f"{os.path.basename(path)} is not valid UTF-8 (byte {exc.start}); undecodable bytes are shown "
                     "as \ufffd")
        return data.decode("utf-8", errors="replace")


def load_table(path: str | Path, notes: list[str]) -> dict:
    """``{"columns": [...], "data": [[...], ...]}`` from a table file; a readable note instead of a traceback."""
    empty = {"columns": [], "data": []}
    name = os.path.basename(path)
    try:
        table = json.loads(_read_text(path, notes))
    except ValueError as exc:  # truncated (a write was cut short) or not JSON at all
        notes.append(f"{name} is not valid JSON ({exc}); the culprit table is left out. "
                     "A truncated file usually means the run was killed while writing it")
        return empty
    except RecursionError:  # e.g. 200k nested lists: no table of ours
        notes.append(f"{name} is nested too deeply to be a table; it is left out")
        return empty
    if not (isinstance(table, dict) and isinstance(table.get("columns"), list) and isinstance(table.get("data"), list)):
        notes.append(f"{name} is not a table (expected an object with \"columns\" and \"data\" lists, "
                     f"got {type(table).__name__}); the culprit table is left out")
        return empty
    cols = table["columns"]
    rows = [r for r in table["data"] if isinstance(r, list) and len(r) == len(cols)]
    if len(rows) != len(table["data"]):
        notes.append(f"{name}: {len(table['data']) - len(rows)} row(s) without exactly {len(cols)} cells "
                     "were left out")
    return {"columns": [str(c) for c in cols], "data": rows}


def wandb_tables(media: Path, kind: str) -> list[Path]:
    """A W&B run's files of table ``spikes/<kind>`` (``kind``: tokens | events): its cumulative
    ``<key>_all`` table (logged once, at ``finish``), else (a run that never finished) each event's,
    in step order. Never "the largest file": one event's table can outnumber a cumulative one whose
    damaged rows were left out."""
    tables = [t for t in (media / "table").rglob("*.table.json") if kind in t.name]
    if kind == "tokens":
        tables = [t for t in tables if "events" not in t.name]
    whole = [t for t in tables if f"{kind}_all_" in t.name]
    return sorted(whole, key=_wandb_table_step)[-1:] if whole else sorted(tables, key=_wandb_table_step)


WANDB_TABLE = re.compile(r"_(\d+)_[0-9a-f]+\.table\.json$")


def _wandb_table_step(p: Path) -> tuple[int, str]:
    m = WANDB_TABLE.search(p.name)
    return (int(m.group(1)) if m else -1, p.name)


def _events(src: ReportSource) -> tuple[dict, dict[int, str], dict[int, bytes]]:
    """(table, step -> page html, step -> png bytes) from either file layout."""
    notes = src.notes
    if src.layout == "wandb":
        media = src.root / "media"
        table = merge_tables(load_table(t, notes) for t in wandb_tables(media, "tokens"))
        pages: dict[int, str] = {}
        html_files = sorted((media / "html").rglob("*.html"), key=_wandb_step)
        order = []
        for p in html_files:
            doc = _read_text(p, notes)
            m = TITLE.search(doc)
            step = int(m.group(1)) if m else _wandb_step(p)
            pages[step] = doc
            order.append(step)
        pngs = sorted((media / "images").rglob("*.png"), key=_wandb_step)
        images = {step: p.read_bytes() for step, p in zip(order, pngs)}  # logged in the same order
        return table, pages, images
    spikes = src.root / "spikes"
    # one part per event (spikes/tokens/step_*.json), or an older run's single tokens.json
    table = merge_tables(load_table(p, notes) for p in table_parts(src.root, "spikes/tokens"))
    pages = {step: _read_text(p, notes) for step, p in _by_step(spikes / "highlight", "html").items()}
    images = {step: p.read_bytes() for step, p in _by_step(spikes / "heatmap", "png").items()}
    return table, pages, images


def _event_table(src: ReportSource) -> dict:
    """Table ``spikes/events``: one row per detected spike (``artifacts.events``), localized or not."""
    notes = src.notes
    if src.layout == "wandb":
        return merge_tables(load_table(t, notes) for t in wandb_tables(src.root / "media", "events"))
    return merge_tables(load_table(p, notes) for p in table_parts(src.root, "spikes/events"))


def _event_notes(events: dict) -> dict[int, str]:
    """step -> why it was not localized, for the detected spikes that were not."""
    cols, data = events.get("columns", []), events.get("data", [])
    if "step" not in cols or "localization" not in cols:
        return {}
    step, why = cols.index("step"), cols.index("localization")
    return {r[step]: str(r[why]) for r in data
            if _is_step(r[step]) and r[why] not in ("localized", "no culprit found")}


def _event_causes(events: dict) -> dict[int, str]:
    """step -> its cause in words (``cause: cause_detail``), for the events that name one."""
    cols, data = events.get("columns", []), events.get("data", [])
    if "step" not in cols or "cause" not in cols or "cause_detail" not in cols:
        return {}  # a run written before causes were named
    step, cause, detail = cols.index("step"), cols.index("cause"), cols.index("cause_detail")
    return {r[step]: f"{r[cause]}: {r[detail] or ''}" for r in data if _is_step(r[step]) and r[cause]}


def _is_step(v) -> bool:
    """A step cell as the trackers write it (a hand-edited ``"abc"`` is not one: its row is not an event)."""
    return isinstance(v, int) and not isinstance(v, bool)


def cell_text(v) -> str:
    """A table cell as the pages show it: floats to 4 digits, None empty, text visible and escaped."""
    if type(v) is int:  # noqa: E721 - the common case; bool is shown as text
        return str(v)
    return html.escape(f"{v:.4g}" if isinstance(v, float) else "" if v is None else visible_text(str(v)))


def _table(table: dict, title: str = "All culprits") -> str:
    cols, data = table.get("columns", []), table.get("data", [])
    if not cols:
        return ""
    tok = cols.index("token") if "token" in cols else -1
    share = cols.index("share") if "share" in cols else -1
    head = "".join(f"<th>{cell_text(c)}</th>" for c in cols)
    body = "".join(
        # a token is cut as on the highlight page: a 10k-character one would push every column off-screen
        "<tr>" + "".join(f"<td class='tok'>{token_html(str(v))}</td>" if i == tok else
                         f"<td>{cell_text(max(v, 0.0) if i == share and _is_number(v) else v)}</td>"
                         for i, v in enumerate(r)) + "</tr>"
        for r in data)
    return f"<h2>{html.escape(title)}</h2><table><tr>{head}</tr>{body}</table>"


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def culprit_counts(table: dict) -> str:
    """``"3 culprit token(s), 1 culprit sample(s)"``: rows by level (a table from before levels
    has token rows only)."""
    cols, data = table.get("columns", []), table.get("data", [])
    lvl = cols.index("level") if "level" in cols else -1
    counts: dict[str, int] = {}
    for r in data:
        name = str(r[lvl]).replace("_", "-") if lvl >= 0 else "token"
        counts[name] = counts.get(name, 0) + 1
    counts.setdefault("token", 0)
    return ", ".join(f"{n} culprit {name}(s)" for name, n in counts.items())


def build_report(source: str | Path, tracking_uri: str | None = None, notes: list[str] | None = None,
                 problems: list[str] | None = None) -> str:
    """The report page for a run directory (any tracker), a W&B run directory, or an MLflow run id.

    Damaged files (truncated or non-table JSON, non-UTF-8 pages) are left out with a note on the
    page; ``notes``, when given, receives the same notes (the CLI prints them). A run dir marked
    incomplete (a full disk) is said first on the page and put in ``problems`` (the CLI's exit 1).
    """
    src = resolve_source(source, tracking_uri)
    if src.incomplete is not None:
        src.notes.insert(0, src.incomplete)
        if problems is not None:
            problems.append(src.incomplete)
    if src.layout == "files" and not (src.root / "spikes").is_dir():
        raise NoSpikeEvents(f"{source}: no spikes/ folder in this run directory; it logged no spike events "
                            "(or pass the run directory the tracker wrote, the one holding spikes/)")
    try:
        table, pages, images = _events(src)
        events = _event_table(src)
    finally:
        if src.temporary:  # everything is in memory now: no download left behind in /tmp
            shutil.rmtree(src.root, ignore_errors=True)
    not_localized, causes = _event_notes(events), _event_causes(events)
    if notes is not None:
        notes.extend(src.notes)
    ev_steps = {r[0] for r in events["data"] if events["columns"][:1] == ["step"] and _is_step(r[0])}
    steps = sorted(set(pages) | set(images) | ev_steps)
    esc = html.escape
    link = (f"<p>Run: <a href=\"{esc(src.link, quote=True)}\">{esc(src.link)}</a></p>"
            if src.link and src.link.startswith(("http://", "https://")) else "")
    parts = [f"<h1>Spike report: {esc(visible_text(src.title))}</h1>", link,
             f"<p>{len(steps)} spike event(s) (steps {esc(', '.join(map(str, steps))) or 'none'}), "
             f"{culprit_counts(table)}.</p>"]
    parts += [f"<p class='note'>{esc(visible_text(n))}</p>" for n in src.notes]
    parts.append(_table(events, "Detected spikes"))
    parts.append(_table(table))
    for step in steps:
        parts.append(f"<h2 id='step-{step}'>step {step}</h2>")
        if step in causes:
            parts.append(f"<p>Cause: {esc(visible_text(causes[step]))}.</p>")
        if step in not_localized:
            parts.append(f"<p>Not localized: {esc(not_localized[step])}.</p>")
        if step in pages:
            # a whole document: escaped into srcdoc, sandboxed (no scripts even if one slipped in)
            parts.append(f"<iframe sandbox title=\"spike at step {step}\" "
                         f"srcdoc=\"{esc(pages[step], quote=True)}\"></iframe>")
        if step in images:
            data = base64.b64encode(images[step]).decode("ascii")
            parts.append(f"<img alt=\"per-layer heatmap, step {step}\" src=\"data:image/png;base64,{data}\">")
    return ("<!DOCTYPE html><html><head><meta charset='utf-8'>"
            f"<meta http-equiv='Content-Security-Policy' content=\"{CSP}\">"
            f"<title>{esc(visible_text(src.title))} - gradloc-track spike report</title><style>{CSS}</style></head>"
            f"<body>{''.join(parts)}</body></html>")
