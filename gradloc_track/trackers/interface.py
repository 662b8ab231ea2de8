"""The tracker interface: a *destination* whose methods do nothing by default.

Each backend overrides only what it supports; calling code never branches on which
backend (or whether any) is configured. ``NullTracker`` is the "logging off" object and
the one non-zero ranks get.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence


class RunNotResumable(ValueError):
    """The backend run a run dir recorded cannot be continued (deleted, purged, in another store): ``replay``
    refuses that backend with this message, which names the fix."""


def exit_status(exc_type: type[BaseException] | None) -> str:
    """The final status of a run ended by ``exc_type``: Ctrl-C (``KeyboardInterrupt``) is "killed"
    (the user stopped it, as SIGTERM does), any other exception "failed", none "success"."""
    if exc_type is None:
        return "success"
    return "killed" if issubclass(exc_type, KeyboardInterrupt) else "failed"


def final_status(status: str) -> str:
    """``status``, except that ``"failed"`` while a ``KeyboardInterrupt`` is in flight (``finish("failed")``
    in an ``except``/``finally`` of a Ctrl-C'd loop) is ``"killed"``."""
    if status == "failed" and exit_status(sys.exc_info()[0]) == "killed":
        return "killed"
    return status


class Tracker:
    """Base destination. All methods are safe no-ops; subclasses override what they support.

    Contract shared by every implementation:
    - ``log_metrics(metrics, step)``: scalar metrics (python floats/ints) at an integer step.
    - ``log_params(params)``: flat mapping of run parameters (values are stringified by backends).
    - ``log_table(key, columns, rows, step)``: rows *appended* to the table named ``key``; no
      backend rewrites what it already holds (``gradloc_track.artifacts.read_table`` reads it back).
    - ``log_html(key, html, step)``: a self-contained HTML document (no scripts, no external CSS).
    - ``log_image(key, path, step)``: a PNG file on local disk.
    - ``log_artifact(path, artifact_path)``: a local file, uploaded as-is.
    - ``set_tags(tags)``: string run tags (e.g. ``spike_count``).
    - ``submit(job)``: run ``job(tracker)`` (slow work such as rendering an artifact) after the
      calls made before it; trackers with ``runs_jobs_off_thread`` do it on their own thread.
    - ``flush(timeout_s=None)``: wait until what was logged so far is written (or spooled); at most
      ``timeout_s`` (``None``: the tracker's own bound).
    - ``finish(status, timeout_s=None)``: flush and close; ``status`` is ``"success"``, ``"failed"``
      or ``"killed"`` (``"failed"`` while a Ctrl-C is in flight counts as ``"killed"``: ``final_status``).
      Never raises into the training loop and returns within ``timeout_s`` (``None``: the tracker's own
      bound). A tracker that calls its backend on the caller's thread (the bare
      W&B/MLflow adapters) cannot cut a call short: ``AsyncTracker`` is what bounds them.
    Every implementation takes these same arguments, so callers never probe the signature.

    File layout (MLflow artifacts and the local run directory use the same relative paths, so
    ``gradloc-track report`` reads either):
    - table ``key`` at ``step`` -> ``<key>/step_<step:06d>.json`` = ``{"columns": [...], "data": [[...], ...]}``,
      one part per event, never rewritten (e.g. ``spikes/tokens/step_000080.json``); older runs
      hold one ``<key>.json``; ``gradloc_track.artifacts.read_table`` reads both;
    - html ``key`` at ``step`` -> ``<key>/step_<step:06d>.html`` (e.g. ``spikes/highlight/step_000080.html``);
    - image ``key`` at ``step`` -> ``<key>/step_<step:06d>.png``;
    - local only: ``metrics.jsonl`` (``{"step": s, "metrics": {...}}`` per line), ``params.json``,
      ``tags.json``. W&B logs tables/html/images under ``key`` at ``step`` (media panels with a step
      slider at the training step) and the cumulative ``<key>_all`` table once, at ``finish``.
    """

    name: str = "none"
    #: True when ``submit``ted jobs run off the calling (training) thread
    runs_jobs_off_thread: bool = False
    #: ``log_metrics`` takes ``timestamp_ms`` (a replayed record is then the same row, not a duplicate)
    accepts_timestamp: bool = False
    #: values one ``log_metric_records`` call takes; None: the background writer sends one step per call
    max_metrics_per_request: int | None = None
    #: where the backend run's files go (MLflow's artifact URI), when apart from where its metrics go: named when
    #: that store alone refuses writes (``async_writer.writer.ARTIFACT_CALLS``)
    artifact_location: str | None = None
    #: True when the artifact store is a service apart from the metrics' (MLflow): the writer then sends
    #: ``ARTIFACT_CALLS`` on a call thread of their own, so an upload stuck in the SDK's retries (a store that answers
    #: 500, retried for minutes) never holds the metrics back. Only for an adapter whose artifact calls share no
    #: state with its other calls.
    artifacts_apart: bool = False
    #: Records lost for good (neither the backend nor the local spool could take them)
    dropped: int = 0
    #: Local directory for files this run writes (spool files, rendered artifacts).
    run_dir: Path | None = None

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        pass

    def log_metric_records(self, records: Sequence[tuple[Mapping[str, float], int, int]]) -> None:
        """Many ``(metrics, step, timestamp_ms)`` records in one call (the writer's batches, replay)."""
        for metrics, step, _ts in records:
            self.log_metrics(metrics, step)

    def log_params(self, params: Mapping[str, Any]) -> None:
        pass

    def log_table(
        self, key: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], step: int | None = None
    ) -> None:
        pass

    def log_html(self, key: str, html: str, step: int | None = None) -> None:
        pass

    def log_image(self, key: str, path: str | Path, step: int | None = None) -> None:
        pass

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        pass

    def set_tags(self, tags: Mapping[str, str]) -> None:
        pass

    def submit(self, job: Callable[["Tracker"], None]) -> None:
        """Run ``job(self)``; here at once, on the calling thread."""
        job(self)

    def flush(self, timeout_s: float | None = None) -> None:
        pass

    def finish(self, status: str = "success", timeout_s: float | None = None) -> None:
        pass

    def run_ref(self) -> dict[str, Any] | None:
        """What ``replay`` needs to find this backend run again (its id and where it lives); None: no run."""
        return None

    # context-manager sugar: a run that raises is finished as "failed" (Ctrl-C: "killed")
    def __enter__(self) -> "Tracker":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.finish(exit_status(exc_type))


class ForwardingTracker(Tracker):
    """Every call goes to ``inner``; a wrapper overrides only the calls it changes (verl's held
    metrics, a shared W&B run's training-thread rows)."""

    def __init__(self, inner: Tracker) -> None:
        self.inner = inner

    @property
    def run_dir(self) -> Path | None:  # type: ignore[override]
        return getattr(self.inner, "run_dir", None)

    @property
    def dropped(self) -> int:  # type: ignore[override]
        return getattr(self.inner, "dropped", 0)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self.inner.log_metrics(metrics, step)

    def log_params(self, params: Mapping[str, Any]) -> None:
        self.inner.log_params(params)

    def log_table(self, key: str, columns: Sequence[str], rows: Sequence[Sequence[Any]],
                  step: int | None = None) -> None:
        self.inner.log_table(key, columns, rows, step)

    def log_html(self, key: str, html: str, step: int | None = None) -> None:
        self.inner.log_html(key, html, step)

    def log_image(self, key: str, path: str | Path, step: int | None = None) -> None:
        self.inner.log_image(key, path, step)

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        self.inner.log_artifact(path, artifact_path)

    def set_tags(self, tags: Mapping[str, str]) -> None:
        self.inner.set_tags(tags)

    def submit(self, job: Callable[["Tracker"], None]) -> None:
        self.inner.submit(job)

    def flush(self, timeout_s: float | None = None) -> None:
        self.inner.flush(timeout_s)

    def finish(self, status: str = "success", timeout_s: float | None = None) -> None:
        self.inner.finish(status, timeout_s)


class NullTracker(Tracker):
    """Logging off. Identical to the base; a named class reads better at call sites."""

    name = "none"

    def submit(self, job) -> None:
        pass  # nothing would be logged: do not even render


#: the calls that write to a backend's artifact store (MLflow's is apart from its tracking store, and may refuse
#: writes the tracking store takes: a read-only folder, a bucket without permission); the writer and ``replay`` keep
#: their records in the spool while the metrics and the run's status go on
ARTIFACT_CALLS = frozenset({"log_table", "log_html", "log_image", "log_artifact"})


def send(tracker: Tracker, call: str, args: Sequence[Any], ts: int | None = None) -> None:
    """One record, as the background writer queues it and the spool keeps it (a call's name and its
    arguments), to ``tracker``'s method of that name. ``ts``: when it was logged (a backend that
    ``accepts_timestamp`` keeps it: a record sent twice is one row)."""
    if call == "log_metrics":
        if tracker.accepts_timestamp and ts is not None:
            tracker.log_metrics(*args, timestamp_ms=ts)  # type: ignore[call-arg]
        else:
            tracker.log_metrics(*args)
    elif call == "log_metric_records":
        tracker.log_metric_records(*args)
    elif call == "log_params":
        tracker.log_params(*args)
    elif call == "log_table":
        tracker.log_table(*args)
    elif call == "log_html":
        tracker.log_html(*args)
    elif call == "log_image":
        tracker.log_image(*args)
    elif call == "log_artifact":
        tracker.log_artifact(*args)
    elif call == "set_tags":
        tracker.set_tags(*args)
    elif call == "finish":
        tracker.finish(*args)
    else:
        raise ValueError(f"gradloc-track: no tracker call {call!r} (a record from a newer version?)")
