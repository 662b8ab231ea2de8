"""MLflow adapter: an explicit run id through ``MlflowClient`` (never the global active run).

Tracking URI: config, else MLflow's own ``MLFLOW_TRACKING_URI``, else ``sqlite:///./mlflow.db``
(MLflow 3 refuses plain folder stores). Key cleaning, param truncation and batching live here.
At creation the run gets the tags MLflow's UI shows in its runs table and run page:
``mlflow.source.name``/``.type``, ``mlflow.source.git.commit`` (in a git checkout),
``mlflow.user``, a description (``mlflow.note.content``) pointing at ``spikes/``, and
``spike_count`` 0 (tag and metric, updated per spike event: the metric at the spike's step) so runs sort by it
(``off``, no metric, for a run without a spike detector). The description
tells the run's spikes as they come (``spike_story``: each one's culprit text and a link to its
highlighted text), on our runs and on a joined run that had none.
Nothing here downloads an artifact or touches ``os.environ``.
"""
from __future__ import annotations

import getpass
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Mapping

from .._optional import require
from .table_json import dumps_table
from .interface import RunNotResumable, Tracker
from .csv_view import csv_text
from .naming import EVENTS_KEY, HTML_KEY, SPIKE_COUNT_OFF, TABLE_KEY, mlflow_key, step_path, table_part_path, truncate
from .reachable import check_server
from .run_record import record_run
from .spike_story import SpikeStory

MAX_METRICS_PER_BATCH = 1000  # MLflow's log_batch limit
MAX_PARAMS_PER_BATCH = 100
MAX_PARAM_VALUE = 6000  # MLflow 3 param value length limit
MAX_TAG_VALUE = 5000
STATUS = {"success": "FINISHED", "failed": "FAILED", "killed": "KILLED"}
DESCRIPTION = ("gradloc-track run. Gradient norms: metrics `grad_norm/*`, clipping `clip/*`, spikes `spike/*`. "
               "Localized spikes are under the artifacts' `spikes/` folder: `spikes/highlight/step_*.html` "
               "(the culprit tokens in their text), `spikes/tokens/step_*.csv` (the culprits: one table part per "
               "event, `.json` the same part for programs), `spikes/events/step_*.csv` (every detected spike), "
               "`spikes/heatmap/step_*.png`. `gradloc-track report <run id>` puts them on one page.")
# the experiment tag MLflow 3's UI reads to pick the experiment's view (mlflow/server/js:
# ExperimentKind); "custom_model_development" is the "Model training" view with runs and charts
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
MODEL_TRAINING_KIND = "custom_model_development"


def resolve_tracking_uri(configured: str | None) -> str:
    """Config wins; then MLflow's own env var; then an SQLite store in the working directory."""
    if configured:
        return configured
    env = os.environ.get("MLFLOW_TRACKING_URI")
    if env:
        return env
    return f"sqlite:///{Path.cwd() / 'mlflow.db'}"


def git_commit(path: str | Path | None = None) -> str | None:
    """HEAD of the git checkout holding ``path`` (default: the working directory), if any."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=path or os.getcwd(), capture_output=True,
                             text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    commit = out.stdout.strip()
    return commit if out.returncode == 0 and len(commit) == 40 else None


def source_tags() -> dict[str, str]:
    """The ``mlflow.*`` tags MLflow's own fluent API sets for a local script run."""
    script = Path(sys.argv[0]).resolve() if sys.argv and sys.argv[0] not in ("", "-c") else None
    tags = {"mlflow.source.type": "LOCAL", "mlflow.note.content": DESCRIPTION}
    if script is not None:
        tags["mlflow.source.name"] = str(script)
    try:
        tags["mlflow.user"] = getpass.getuser()
    except Exception:  # noqa: BLE001 - no user database entry (containers)
        pass
    commit = git_commit(script.parent if script is not None and script.parent.is_dir() else None)
    if commit:
        tags["mlflow.source.git.commit"] = commit
    return tags


CANCELLED = "opening the MLflow run was cancelled: finish() gave up waiting for the server"


def _check(cancel: Any) -> None:
    if cancel is not None and cancel.is_set():
        raise RuntimeError(CANCELLED)


class MlflowTracker(Tracker):
    name = "mlflow"
    #: log_metrics takes ``timestamp_ms``: a record replayed with its original timestamp is the
    #: same row to MLflow's store, which drops exact duplicates
    accepts_timestamp = True
    #: ``log_metric_records`` sends this many values in one ``log_batch`` request (the writer's batches)
    max_metrics_per_request = MAX_METRICS_PER_BATCH
    #: the artifact store is apart from the tracking store (a server's ``--artifacts-destination``, a bucket), and
    #: the artifact calls' own state (the description's story) is theirs alone: the writer sends them on a thread
    #: of their own
    artifacts_apart = True

    def __init__(self, tracking_uri: str | None = None, experiment_name: str = "gradloc-track",
                 run_name: str | None = None, tags: Mapping[str, str] | None = None,
                 run_dir: str | Path | None = None, cancel: Any = None,
                 run_id: str | None = None) -> None:
        """``run_id`` attaches to a run someone else opened (HF Trainer, Lightning, the user): log
        into it and leave it open at ``finish()``; without it a new run is created and owned.

        ``cancel``: an ``OpenGate`` (``is_set()`` before each step; ``claim()`` once the run exists). A
        run whose creation was answered after ``finish()`` gave up is ended as KILLED, deleted, and
        never recorded in the run directory: ``replay`` made (or will make) the run that is."""
        self._connect(tracking_uri, run_dir)
        if run_id is not None:
            self._attach(run_id)
            return
        exp = self.client.get_experiment_by_name(experiment_name)
        _check(cancel)
        if exp is None:
            try:
                exp_id = self.client.create_experiment(experiment_name)
            except Exception:  # created concurrently by a sibling multirun job
                exp_id = self.client.get_experiment_by_name(experiment_name).experiment_id
        else:
            exp_id = exp.experiment_id
        if exp is None or EXPERIMENT_KIND_TAG not in (exp.tags or {}):
            # MLflow 3's UI opens an experiment without this tag in its GenAI view ("Traces 0")
            self.client.set_experiment_tag(exp_id, EXPERIMENT_KIND_TAG, MODEL_TRAINING_KIND)
        _check(cancel)
        tags = {**source_tags(), "spike_count": "0", **dict(tags or {})}
        run = self.client.create_run(exp_id, run_name=run_name, tags=tags)
        self.run_id, self.run_name = run.info.run_id, run.info.run_name
        self.artifact_location = run.info.artifact_uri
        self.experiment_id = exp_id
        if cancel is not None and not cancel.claim():
            self._end_late_run()
            raise RuntimeError(CANCELLED + f"; its late run {self.run_id} was ended and deleted")
        self._record()
        # spike_count 0 at step 0, so the runs table sorts by it from the start; a run without a spike detector
        # (``spike_count`` "off": it looked for none) has no count to sort by (held-out tester, stop 63: it read 0)
        self._start_pending = tags["spike_count"] != SPIKE_COUNT_OFF
        try:
            self.log_metrics({}, 0)
        except Exception:  # noqa: BLE001 - the run exists: raising here made the opener's retry create a
            pass  # second one, left RUNNING and empty (tester round 12); the next log call sends it

    def _attach(self, run_id: str) -> None:
        """Log into a run someone else opened; recorded like a run we open, so the run dir leads to it."""
        run = self.client.get_run(run_id)
        info = run.info
        self.attached = True
        note = (run.data.tags or {}).get("mlflow.note.content")
        self._note_free = note is None or DESCRIPTION[:80] in note  # never overwrite the owner's; ours goes on
        self.run_id, self.run_name, self.experiment_id = run_id, info.run_name, info.experiment_id
        self.artifact_location = info.artifact_uri
        self._seen_spike_count(run)
        self._record()
        if note is not None and self._note_free:
            self._read_story()

    def _seen_spike_count(self, run: Any) -> None:
        """The ``spike_count`` tag a run joined or resumed already has (a number; "off" or none: 0)."""
        try:
            self._spike_count = int((run.data.tags or {}).get("spike_count", 0))
        except (TypeError, ValueError):
            self._spike_count = 0

    def _read_story(self) -> None:
        """A resumed run we told the story of (its description is ours): the spikes its earlier processes
        logged join the story, so the description goes on from them (held-out tester, stop 56: a resume's
        description kept "1 gradient spike(s) detected, at step 60" while step 100 spiked). Every earlier
        spike's step, from its ``spikes/events`` part's name; the parts themselves (its row, its culprits) of the
        steps the description tells in full only: a few downloads, whatever the run's length."""
        from .spike_story import MAX_STEPS

        try:
            with tempfile.TemporaryDirectory() as tmp:
                parts = {key: self._part_steps(key) for key in (EVENTS_KEY, TABLE_KEY)}
                told = set(sorted(parts[EVENTS_KEY])[:MAX_STEPS])
                for step in parts[EVENTS_KEY]:
                    self._story.seed_step(step)
                for key in (EVENTS_KEY, TABLE_KEY):
                    for step, path in parts[key].items():
                        if step in told:
                            doc = json.loads(Path(self.client.download_artifacts(self.run_id, path, tmp))
                                             .read_text("utf-8"))
                            self._story.seed(key, doc["columns"], doc["data"])
        except Exception:  # noqa: BLE001 - the story is a view; the tables are the record
            return

    def _part_steps(self, key: str) -> dict[int, str]:
        """step -> artifact path of each JSON part of table ``key`` in the run (one listing, no download)."""
        out = {}
        for f in self.client.list_artifacts(self.run_id, key):
            name = Path(f.path).name
            if not f.is_dir and name.startswith("step_") and name.endswith(".json") and name[5:-5].isdigit():
                out[int(name[5:-5])] = f.path
        return out

    def _record(self) -> None:
        """The run's ``view`` in the run dir's record: ``report``, ``culprits`` and the console follow it."""
        record_run(self.run_dir, "mlflow", {"tracking_uri": self.tracking_uri, "experiment_id": self.experiment_id,
                                            "run_id": self.run_id, "run_name": self.run_name})

    def _end_late_run(self) -> None:
        """A run nobody will log to (its creation outlived ``finish()``): KILLED, then deleted."""
        try:
            self.client.set_terminated(self.run_id, "KILLED")
            self.client.delete_run(self.run_id)
        except Exception:  # noqa: BLE001 - best effort: the run dir never points at it either way
            pass

    @classmethod
    def resume(cls, run_id: str, tracking_uri: str | None = None, run_dir: str | Path | None = None) -> "MlflowTracker":
        """Continue an existing run (``gradloc-track replay``); its status is left as it is."""
        self = cls.__new__(cls)
        self._connect(tracking_uri, run_dir)
        run = self._resumable_run(run_id)
        self.run_id, self.experiment_id = run_id, run.info.experiment_id
        self.artifact_location = run.info.artifact_uri
        self._seen_spike_count(run)
        note = (run.data.tags or {}).get("mlflow.note.content")
        self._note_free = note is None or DESCRIPTION[:80] in note  # a joined run's owner's description stays theirs
        if note is not None and self._note_free:
            self._read_story()  # the description goes on from the spikes already in the run (held-out tester, stop
            # 64: a replay told only the replayed tables' spikes)
        return self

    def _resumable_run(self, run_id: str) -> Any:
        """The run ``resume`` continues; ``RunNotResumable`` naming the fix when it is deleted or not in this
        store (before: MLflow's traceback at the first record, "must be in the 'active' state")."""
        from mlflow.exceptions import MlflowException

        try:
            run = self.client.get_run(run_id)
        except MlflowException as exc:
            if getattr(exc, "error_code", "") != "RESOURCE_DOES_NOT_EXIST":
                raise
            raise RunNotResumable(
                f"the MLflow run {run_id} is not in {self.tracking_uri}: it was purged (`mlflow gc`), or the "
                "store moved (pass --tracking-uri <the store that holds it>). To send the records to a new run "
                "instead, remove the run dir's tracker/mlflow.json") from None
        if run.info.lifecycle_stage == "deleted":
            raise RunNotResumable(
                f"the MLflow run {run_id} in {self.tracking_uri} is deleted: restore it (`mlflow runs restore "
                f"--run-id {run_id}`, or the UI's trash) and replay again; to send the records to a new run "
                "instead, remove the run dir's tracker/mlflow.json")
        return run

    def _connect(self, tracking_uri: str | None, run_dir: str | Path | None) -> None:
        require("mlflow", "mlflow")
        from mlflow.tracking import MlflowClient

        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.tracking_uri = resolve_tracking_uri(tracking_uri)
        check_server(self.tracking_uri)  # a server that is not running: said at once, with its address
        self.client = MlflowClient(tracking_uri=self.tracking_uri)
        self.attached = False  # True: logging into a run someone else opened (never ended here)
        self._start_pending = False  # the opening spike_count 0 is still to be sent (the first log call sends it)
        self._story, self._note_free = SpikeStory(), True  # the run page's description (spike_story.py)
        self._spike_count = 0  # the largest spike_count tag this run has had: a replayed older one never lowers it
        self._last_part: tuple[str, int | None, list[list[Any]]] | None = None

    def where(self) -> str:
        """One line saying where this run is: its name, id, store and link."""
        from .mlflow_links import mlflow_run_url, mlflow_ui_command

        info = {"tracking_uri": self.tracking_uri, "experiment_id": self.experiment_id, "run_id": self.run_id}
        serve = mlflow_ui_command(self.tracking_uri)
        return (f"MLflow run {getattr(self, 'run_name', None) or self.run_id!r} (id {self.run_id}) in "
                f"{self.tracking_uri}: {mlflow_run_url(info)}" + (f" (serve the store: {serve})" if serve else ""))

    def run_ref(self) -> dict[str, str]:
        """What ``replay`` needs to find this run again."""
        return {"run_id": self.run_id, "experiment_id": self.experiment_id, "tracking_uri": self.tracking_uri}

    def log_metrics(self, metrics: Mapping[str, float], step: int, timestamp_ms: int | None = None) -> None:
        from mlflow.entities import Metric

        ts = int(time.time() * 1000) if timestamp_ms is None else int(timestamp_ms)
        items = [Metric(mlflow_key(k), float(v), ts, int(step)) for k, v in metrics.items()]
        start = self._start_pending
        if start:
            items.insert(0, Metric("spike_count", 0.0, ts, 0))
        for i in range(0, len(items), MAX_METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=items[i: i + MAX_METRICS_PER_BATCH], synchronous=True)
            if start:
                self._start_pending = start = False

    def log_metric_records(self, records: list[tuple[Mapping[str, float], int, int]]) -> None:
        """Many ``(metrics, step, timestamp_ms)`` records in as few requests as possible (replay)."""
        from mlflow.entities import Metric

        items = [Metric(mlflow_key(k), float(v), int(ts), int(step)) for metrics, step, ts in records
                 for k, v in metrics.items()]
        start = self._start_pending
        if start:  # the opening spike_count the constructor could not send
            items.insert(0, Metric("spike_count", 0.0, items[0].timestamp if items else int(time.time() * 1000), 0))
        for i in range(0, len(items), MAX_METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=items[i: i + MAX_METRICS_PER_BATCH], synchronous=True)
            if start:
                self._start_pending = start = False

    def log_params(self, params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        # None means "not set": as the string "None" it is noise in the params table
        items = [Param(mlflow_key(k), truncate(v, MAX_PARAM_VALUE)) for k, v in params.items() if v is not None]
        for i in range(0, len(items), MAX_PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=items[i: i + MAX_PARAMS_PER_BATCH], synchronous=True)

    def log_table(self, key, columns, rows, step=None) -> None:
        # one part per event, uploaded once: never download-append-upload a growing file (that is
        # what MlflowClient.log_table does, with a progress bar per event and quadratic traffic)
        rows = [list(r) for r in rows]
        told = self._story.add(key, columns, rows)
        if self._last_part is not None and self._last_part[:2] == (key, step):
            rows = self._last_part[2] + rows  # a second call for the same event: one part
        self._last_part = (key, step, rows)
        self.client.log_text(self.run_id, dumps_table(columns, rows), table_part_path(key, step))
        # the same part as CSV, which MLflow's artifact viewer shows as a table (JSON it shows raw)
        self.client.log_text(self.run_id, csv_text(columns, rows), step_path(key, step, "csv"))
        if told and self._note_free:
            self._tell_story()

    def _tell_story(self) -> None:
        """The description: the spikes so far (culprit text, a link to each one's page), then what is where."""
        from .mlflow_links import MODEL_TRAINING_VIEW

        def link(step: int, localized: bool) -> str:  # relative: it opens on whichever host serves the UI
            page = step_path(HTML_KEY, step, "html") if localized else step_path(EVENTS_KEY, step, "csv")
            return f"#/experiments/{self.experiment_id}/runs/{self.run_id}/artifacts/{page}?{MODEL_TRAINING_VIEW}"

        note = f"{self._story.markdown(link)}\n\n{DESCRIPTION}"
        try:
            self.client.set_tag(self.run_id, "mlflow.note.content", truncate(note, MAX_TAG_VALUE))
        except Exception:  # noqa: BLE001 - a description is a view of the tables just logged, never the record
            pass

    def log_html(self, key, html, step=None) -> None:
        self.client.log_text(self.run_id, html, step_path(key, step, "html"))

    def log_image(self, key, path, step=None) -> None:
        rel = step_path(key, step, "png")
        with tempfile.TemporaryDirectory() as tmp:
            dst = Path(tmp) / Path(rel).name
            dst.write_bytes(Path(path).read_bytes())
            self.client.log_artifact(self.run_id, str(dst), artifact_path=str(Path(rel).parent))

    def log_artifact(self, path, artifact_path=None) -> None:
        self.client.log_artifact(self.run_id, str(path), artifact_path=artifact_path)

    def set_tags(self, tags: Mapping[str, str]) -> None:
        """Run tags. ``spike_count`` never goes down: ``replay`` may send an older count after a newer one (held-out
        tester, stop 64: a run with 12 spikes was left tagged 3). Its metric is logged at each spike's step by the
        artifact writer, so MLflow's latest value is the last spike's count whatever order the points arrive in."""
        from mlflow.entities import RunTag

        tags = dict(tags)
        count = tags.get("spike_count")
        if count is not None and str(count).isdigit():
            if int(count) < self._spike_count:
                del tags["spike_count"]
            else:
                self._spike_count = int(count)
        if not tags:
            return
        items = [RunTag(mlflow_key(k), truncate(v, MAX_TAG_VALUE)) for k, v in tags.items()]
        self.client.log_batch(self.run_id, tags=items, synchronous=True)

    def finish(self, status: str = "success", timeout_s: float | None = None) -> None:
        """End the run we opened (not one we joined). One blocking call: ``AsyncTracker`` bounds it."""
        if self.attached:  # never end a run we did not open
            return
        self.client.set_terminated(self.run_id, STATUS.get(status, "FAILED"))

    def end_if_running(self, status: str = "killed") -> bool:
        """End the run as ``status`` if it is still RUNNING (its process died); ``False`` when it had ended."""
        if self.client.get_run(self.run_id).info.status != "RUNNING":
            return False
        self.client.set_terminated(self.run_id, STATUS.get(status, "FAILED"))
        return True
