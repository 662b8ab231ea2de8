"""One standalone HTML page with every spike event of a run, for people on neither W&B nor MLflow.

Reads the shared file layout (``spikes/events/step_*.json``: every detected spike, localized or
not; ``spikes/tokens/step_*.json`` or an older ``spikes/tokens.json``,
``spikes/highlight/step_*.html``, ``spikes/heatmap/step_*.png``, see ``trackers/interface.py``) from a
local run directory; else each backend's entry (``trackers.backends``) says where its run's files
are: an MLflow run's downloaded, a W&B run folder's media, a TensorBoard log dir's events.
Event pages (whole documents) are embedded as sandboxed
``<iframe srcdoc>`` with the document escaped into the attribute; images as base64 data URIs. The
page has no script and loads nothing from outside.
"""
from __future__ import annotations

import base64
import html
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from .artifacts.table_store import decode_text, load_table, merge_tables, parse_table, table_parts
from .run_dirs import WHAT, detection_was_off, find_run_dirs, run_dir_of, run_keys, run_locations
from .text import token_html, visible_text
from .trackers.backends import BACKENDS, NoSpikeEvents, ReportSourceError, RunFiles  # (their errors, re-exported)
from .trackers.backends.mlflow import MLFLOW_WAIT_S, RUN_ID  # noqa: F401 - MLFLOW_WAIT_S: the ledger's bound too
from .trackers.incomplete import incomplete_reason
from .trackers.naming import DETECTION_OFF, EVENTS_KEY, TABLE_KEY
from .trackers.run_record import unreadable_records
from .trackers.spool import spooled_tables

STEP = re.compile(r"step_(\d+)\.(html|png)$")
CSS = ("body{font-family:system-ui,sans-serif;margin:16px} table{border-collapse:collapse;font-size:12px}"
       "td,th{border:1px solid #ccc;padding:2px 5px} iframe{width:100%;height:480px;border:1px solid #ddd}"
       "img{max-width:100%} p.note{color:#a40} "
       "td.tok{font-family:ui-monospace,Menlo,Consolas,monospace;white-space:pre} .cut{color:#888}")
CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:"


class IncompleteRunDir(NoSpikeEvents):
    """A run dir marked ``INCOMPLETE`` (``trackers.incomplete``) that holds no spike files: its writes
    failed, so "no spike events" would be a guess."""


TITLE = re.compile(r"<title>spike at step (\d+)</title>")


@dataclass
class ReportSource(RunFiles):
    """Where a report's files are (``RunFiles``: the folder holding ``spikes/``, or a backend's reader),
    its title, a link back to the run, which run it is, and whether the run dir is all of it."""

    incomplete: str | None = None  # why the run dir is not the whole run (``trackers.incomplete``), if it is not

    @classmethod
    def of(cls, files: RunFiles) -> "ReportSource":
        return files if isinstance(files, cls) else cls(**vars(files))


def not_a_run_dir(folder: Path) -> str:
    """What to say about a folder that is no run dir: the run dirs it holds, or what a run dir is."""
    found = find_run_dirs(folder)
    if not found:
        return f"{folder} is not a run dir and holds none; {WHAT}"
    listed = ", ".join(map(str, found[:3])) + (f" (+{len(found) - 3} more)" if len(found) > 3 else "")
    return f"{folder} is not a run dir; it holds {len(found)}: {listed}; pass one (culprits takes the whole folder)"


def _from_run_dir(run: Path, tracking_uri: str | None) -> ReportSource:
    """A run dir's files (its ``spikes/``, else the MLflow run or W&B files its run record names), with
    ``incomplete`` set when some of its writes failed, and every identity of its run (``run_keys``)."""
    incomplete = incomplete_reason(run)
    src = _sources_of(run, tracking_uri, incomplete)
    src.incomplete = incomplete
    return src


def _sources_of(run: Path, tracking_uri: str | None, incomplete: str | None) -> ReportSource:
    where = run_locations(run)
    if (run / "spikes").is_dir():  # the shared layout in the run dir: named after its first backend run
        views = [(b, where[name]) for name, b in BACKENDS.items() if name in where]
        title = next((v["run_name"] for _, v in views if v.get("run_name")), run.name)
        link = next((u for u in (b.link(v) for b, v in views) if u), None)
        keys = run_keys(run, where)
        return ReportSource(run, title, link, run_id=keys[0], aliases=tuple(keys))
    for name, b in BACKENDS.items():  # else the run the record names, or a backend's own folder in (or at) it
        files = b.report_files(run, where.get(name), tracking_uri)
        if files is not None:
            src = ReportSource.of(files)
            src.aliases = tuple(run_keys(run, where))
            return src
    backends = f" (its {' and '.join(where)} run has none either)" if where else ""
    if incomplete is not None:
        raise IncompleteRunDir(f"{incomplete}; it holds no spike files{backends}")
    broken = unreadable_records(run)
    if broken:  # the record that leads to the backend run is damaged: "no spike events" would be a guess
        raise IncompleteRunDir(f"{run}: {'; '.join(broken.values())}, so the tracker run this run dir logged to "
                               "(where its spike events are) cannot be found from it; a truncated file usually means "
                               "the run was killed while writing it. Pass that run itself (an MLflow run id, with "
                               "--tracking-uri; a W&B run folder) or restore the file")
    spooled = spooled_tables(run)
    if spooled:  # the tracker was down: its spike tables wait in the spool, not "no spike events"
        raise IncompleteRunDir(f"{run}: its spike tables are in {' and '.join(spooled)}, not sent yet (the tracker was "
                               f"down): run `gradloc-track replay {run}` first, then this again")
    raise NoSpikeEvents(f"{run}: a run dir with no spikes/ folder{backends}: "
                        + (DETECTION_OFF if detection_was_off(run) else "it logged no spike events"))


def resolve_source(source: str | Path, tracking_uri: str | None = None) -> ReportSource:
    """A run dir (any tracker: follows ``tracker/<backend>.json``; or its ``spikes/``), a backend's own
    run folder (W&B's, a TensorBoard log dir), or a run id (MLflow's). ``ReportSourceError`` says what is
    wrong (``NoSpikeEvents``: a run without any)."""
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
    for b in BACKENDS.values():
        files = b.find_run(text, tracking_uri)
        if files is not None:
            return ReportSource.of(files)
    raise ReportSourceError(f"{source}: no run directory and no run of {', '.join(BACKENDS)} by that id")


def _by_step(folder: Path, ext: str) -> dict[int, Path]:
    out = {}
    for p in sorted(folder.glob(f"step_*.{ext}")) if folder.is_dir() else []:
        m = STEP.search(p.name)
        if m:
            out[int(m.group(1))] = p
    return out


def _read_text(path: str | Path, notes: list[str]) -> str:
    with open(path, "rb") as f:
        return decode_text(f.read(), os.path.basename(path), notes)


def _events(src: ReportSource) -> tuple[dict, dict[int, str], dict[int, bytes]]:
    """(table, step -> page html, step -> png bytes) from the run dir's layout or the backend's reader."""
    notes, reader = src.notes, src.reader
    if reader is not None:
        table = merge_tables(parse_table(data, name, notes) for name, data in reader.tables("tokens"))
        pages = {step: decode_text(doc, f"the page of step {step}", notes) for step, doc in reader.pages().items()}
        return table, pages, reader.images()
    spikes = src.root / "spikes"
    # one part per event (spikes/tokens/step_*.json), or an older run's single tokens.json
    table = merge_tables(load_table(p, notes) for p in table_parts(src.root, TABLE_KEY))
    pages = {step: _read_text(p, notes) for step, p in _by_step(spikes / "highlight", "html").items()}
    images = {step: p.read_bytes() for step, p in _by_step(spikes / "heatmap", "png").items()}
    return table, pages, images


def _event_table(src: ReportSource) -> dict:
    """Table ``spikes/events``: one row per detected spike (``artifacts.events``), localized or not."""
    notes = src.notes
    if src.reader is not None:
        return merge_tables(parse_table(data, name, notes) for name, data in src.reader.tables("events"))
    return merge_tables(load_table(p, notes) for p in table_parts(src.root, EVENTS_KEY))


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


AFTERMATH = re.compile(r"^\w+: aftermath of step (\d+)")  # a linked event's cause (``spikes/incidents.py``)


def _incidents(steps: list[int], causes: dict[int, str]) -> str:
    """``" in 1 incident (3 of them its aftermath)"`` when some events are the aftermath of an earlier one (a
    tester, stop 55: "4 spike event(s)" read as four problems for one bad batch and its recovery); ``""`` when
    none is. Every event that is no aftermath (a cause or not) is an incident; when all are, their incident's
    step is said instead (it is in no event row: a resumed run's)."""
    linked = [m for m in (AFTERMATH.match(causes.get(s, "")) for s in steps) if m]
    after = len(linked)
    if not after:
        return ""
    n = len(steps) - after
    if not n:
        return f" (all the aftermath of step {', '.join(sorted({m.group(1) for m in linked}, key=int))})"
    return f" in {n} incident(s) ({after} of them {'its' if n == 1 else 'their'} aftermath)"


def _is_step(v) -> bool:
    """A step cell as the trackers write it (a hand-edited ``"abc"`` is not one: its row is not an event)."""
    return isinstance(v, int) and not isinstance(v, bool)


def cell_text(v) -> str:
    """A table cell as the pages show it: floats to 4 digits, None empty, text visible and escaped."""
    if type(v) is int:  # noqa: E721 - the common case; bool is shown as text
        return str(v)
    return html.escape(f"{v:.4g}" if isinstance(v, float) else "" if v is None else visible_text(str(v)))


# the events table's columns as the page heads them: the lead signal may be a loss or a junk run's excess, not a
# gradient norm (held-out tester, stop 54: a junk event's 'norm 0.84, running_mean -6.0'); the logged names stay
EVENT_HEADS = {"norm": "value", "running_mean": "baseline", "layers": "other signals"}


def _table(table: dict, title: str = "All culprits", heads: dict[str, str] | None = None) -> str:
    cols, data = table.get("columns", []), table.get("data", [])
    if not cols:
        return ""
    tok = cols.index("token") if "token" in cols else -1
    share = cols.index("share") if "share" in cols else -1
    head = "".join(f"<th>{cell_text((heads or {}).get(c, c))}</th>" for c in cols)
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
    if src.reader is None and not (src.root / "spikes").is_dir():
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
             f"<p>{len(steps)} spike event(s) (steps {esc(', '.join(map(str, steps))) or 'none'})"
             f"{_incidents(steps, causes)}, "
             f"{culprit_counts(table)}.</p>"]
    parts += [f"<p class='note'>{esc(visible_text(n))}</p>" for n in src.notes]
    parts.append(_table(events, "Detected spikes", EVENT_HEADS))
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
