"""Where to look at a run: each backend run's links (its entry in ``trackers.backends`` says them) and
the local files, and the commands that open them."""
from __future__ import annotations

from pathlib import Path

from ..trackers.backends import views_of
from ..trackers.naming import EVENTS_KEY, HTML_KEY, step_path
from ..trackers.run_record import read_run_views


def highlight_page(step: int) -> str:
    return step_path(HTML_KEY, step, "html")


def event_page(step: int) -> str:
    """The spike's row of ``spikes/events`` as MLflow's UI shows it (a table; see ``trackers.csv_view``)."""
    return step_path(EVENTS_KEY, step, "csv")


def where_to_look(run_dir: Path, step: int | None = None, page: str | None = None) -> list[str]:
    """Each backend run's line (an MLflow link to artifact ``page`` of the run, default: the step's
    highlight page; the W&B run; the TensorBoard log dir), then the local files: whatever this run has."""
    if step is not None and page is None:
        page = highlight_page(step)
    out = [line for b, view in views_of(read_run_views(run_dir)) for line in b.where(view, page)]
    from ..trackers.join import is_scratch

    if is_scratch(run_dir):  # removed when the run ends: never shown as a place to look
        return out or ["no run dir: pass run_dir= to keep this run's files"]
    local = run_dir / "spikes"
    if local.is_dir():
        out.append(f"local files: {local}")
    elif (run_dir / "rendered").is_dir():
        out.append(f"local files: {run_dir / 'rendered'}")
    if not out:  # nothing there yet: rendered after this block, or a tracker run still opening (a new store)
        out.append(f"run dir: {run_dir} (the spike's files are on their way; a tracker run's link is printed "
                   "once it opens)")
    return out


def spike_link(run_dir: Path, step: int, localized: bool) -> str | None:
    """The first backend's link straight to a spike's page (MLflow's artifact viewer): its highlight when
    localized, else its ``spikes/events`` row; None when no backend run of this run dir has such links."""
    page = highlight_page(step) if localized else event_page(step)
    return next((u for u in (b.page_link(v, page) for b, v in views_of(read_run_views(run_dir))) if u), None)


def view_commands(run_dir: Path, spikes: bool = True) -> list[str]:
    """The exact commands to look at the results (``spikes=False``: the run logged no spike, so no report
    command, which would only say so)."""
    out = [line for b, view in views_of(read_run_views(run_dir)) for line in b.commands(view)]
    if spikes:
        from ..trackers.spool import spooled_tables

        if spooled_tables(run_dir):  # the tracker was down: the report reads the spike tables once they are sent
            out.append(f"  gradloc-track replay {run_dir}    # first: the spike tables wait in its spool")
        out.append(f"  gradloc-track report {run_dir} -o spike_report.html    # one HTML page, no server needed")
    return out
