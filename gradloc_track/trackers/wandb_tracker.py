"""Weights & Biases adapter, following W&B's own conventions.

``WANDB_MODE``/``WANDB_DIR`` are respected when the config leaves ``mode``/``dir`` unset.
Steps, in a run we open: every ``run.log`` passes ``step=`` our training step, so W&B's own step
(what the media panels' step slider shows) IS the training step; ``define_metric`` also plots every
chart against ``train/step``. A record for an older step (W&B only appends) is logged at the latest
step rather than dropped.
Steps, in a run we join (``run=``): a framework's run (HF Trainer, Lightning) gets rows of its own
carrying the framework's step metric (``step_key``); the user's own ``wandb.run``
(``shared_rows=True``) gets our records in the user's rows, W&B's step left to the user, a spike's
media at ``gradloc/media_step`` (``wandb_shared``).
Tables: one small table per event at its step; the cumulative ``<key>_all`` table is logged
ONCE, at ``finish`` (re-logging it per event grows the run quadratically).
W&B types each table column by its first rows and refuses a row with a cell of another type (a
user's list-valued ``sample_id``, a hand-made ``share``): our tables allow mixed types, so one odd cell
never keeps a spike's table (and, after it, every record: the writer takes the error for an outage)
from W&B; the readers (``ledger/rows``) leave such a row out, named.
Files: names W&B reserves for itself in a run's files (``config.yaml``, ...) are saved under
``gradloc-<name>``.
"""
from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path
from typing import Any, Mapping, Sequence

from .._optional import require
from .interface import Tracker
from .files import atomic_write_json
from .naming import RUN_FILE
from .run_record import record_run
from .spike_story import SpikeStory

STEP_KEY = "train/step"
SHARED_STEP_KEY = "gradloc/step"  # our x-axis in the user's own run: never a key of theirs
RESERVED_FILES = {"config.yaml", "wandb-metadata.json", "wandb-summary.json", "requirements.txt", "output.log",
                  "diff.patch", "conda-environment.yaml"}
EXIT_CODE = {"success": 0, "failed": 1, "killed": 143}  # 143 = 128 + SIGTERM
OWN_PREFIXES = ("grad_norm", "weight_norm", "grad_weight_ratio", "clip", "spike", "spikes", "locate", "adamc")


class WandbTracker(Tracker):
    """The W&B destination; a public constructor (``tracker.wandb`` config fields, by name).

    A run we open: ``project``, ``entity``, ``tags``, ``mode`` (``online``/``offline``/``disabled``;
    ``None``: ``WANDB_MODE``), ``dir`` (``None``: ``WANDB_DIR``, else ``run_dir``), ``group``,
    ``run_name``; ``run_dir``: our own files for this run (the run record). A run someone else
    opened: ``run`` (with ``step_key``, ``shared_rows``; see ``__init__``). ``cancel``: the background
    writer's ``OpenGate``. The background writer (``async_writer``) is what calls it in a training run.
    """

    name = "wandb"
    #: the writer's batches: ``log_metric_records`` logs the steps one by one inside one call
    max_metrics_per_request = 1000

    def __init__(self, project: str = "gradloc-track", entity: str | None = None, tags: Sequence[str] = (),
                 mode: str | None = None, dir: str | None = None, group: str | None = None,
                 run_name: str | None = None, run_dir: str | Path | None = None, run: Any = None,
                 step_key: str = STEP_KEY, shared_rows: bool = False, cancel: Any = None,
                 same_run: str | None = None) -> None:
        """``run`` attaches to a run someone else opened (``wandb.run``, Trainer's, Lightning's):
        log into it at ``step_key`` and leave it open at ``finish()``; ``shared_rows``: in the
        owner's rows at ``gradloc/step``, never moving W&B's step (``wandb_shared``). ``cancel``: an
        ``OpenGate``; a run whose creation outlived ``finish()`` is ended and not recorded. ``same_run``: the
        identity this run shares with the other backend's run of ``tracker=both``, written into its files
        (``naming.RUN_FILE``)."""
        if run is not None:
            self._attach(run, run_dir, SHARED_STEP_KEY if shared_rows else step_key, shared_rows)
            return
        self._init(dir, run_dir, cancel, project=project, entity=entity, tags=list(tags) or None, mode=mode,
                   group=group, name=run_name, reinit="create_new")
        if same_run:
            self._note_run(same_run=same_run)

    @classmethod
    def resume(cls, run_id: str, project: str = "gradloc-track", entity: str | None = None, mode: str | None = None,
               dir: str | None = None, run_dir: str | Path | None = None, same_run: str | None = None,
               **_: Any) -> "WandbTracker":
        """Continue an existing run (``gradloc-track replay``); ``same_run``: the identity it shares with its MLflow
        sibling (``tracker=both``), written again into the resumed run's files (review, stop 64: a replayed run's
        notes held its params only, and the ledger counted the pair twice)."""
        self = cls.__new__(cls)
        self._init(dir, run_dir, None, project=project, entity=entity, mode=mode, id=run_id, resume="allow",
                   reinit="create_new")
        if same_run:
            self._note_run(same_run=same_run)
        return self

    def _require_login(self, mode: str | None) -> None:
        """An online run needs W&B credentials. Without them ``wandb.init`` prompts for them on a terminal,
        from the tracker's thread: the prompt competes with the user's input, the open waits out its bound,
        and the thread still reading stdin at exit aborted the finished run (exit 134). Looked up without a
        prompt; none: W&B's own ``UsageError``, as without a terminal (the closing lines say ``wandb login``)."""
        mode = mode or os.environ.get("WANDB_MODE") or self._settings_mode()
        if mode in ("offline", "dryrun", "disabled") or os.environ.get("WANDB_DISABLED", "").lower() in ("1", "true"):
            return
        if not self.wandb.login(prompt=False, verify=False):
            raise self.wandb.errors.UsageError("No API key configured. Use `wandb login` to log in, or set "
                                               "WANDB_MODE=offline to log to a local run folder")

    def _settings_mode(self) -> str | None:
        """The mode W&B's settings files hold (``wandb offline`` writes ``mode = offline`` to ``./wandb/settings``;
        ``wandb.init`` honours it, so a run there needs no login)."""
        try:
            return self.wandb.setup().settings.mode
        except Exception:  # settings W&B cannot read: it will say so itself at init
            return None

    def _attach(self, run: Any, run_dir: str | Path | None, step_key: str, shared_rows: bool) -> None:
        from .wandb_shared import SharedRows

        self.wandb = require("wandb", "wandb")
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.run, self.step_key, self.attached = run, step_key, True
        self.shared = SharedRows(run, step_key) if shared_rows else None
        # only our own key prefixes: the owner's define_metric("*") setup stays as it is
        self.run.define_metric(step_key)
        for prefix in OWN_PREFIXES:
            self.run.define_metric(f"{prefix}/*", step_metric=step_key)
        self._step = -1
        self._tables: dict[str, tuple[list[str], list[list[Any]]]] = {}
        self._init_args = {"project": getattr(run, "project", None), "entity": getattr(run, "entity", None),
                           "mode": None, "dir": None}
        self._record()  # a joined run is recorded like one we open: the run dir leads to it

    def _init(self, dir: str | None, run_dir: str | Path | None, cancel: Any, **init: Any) -> None:
        self.wandb = require("wandb", "wandb")
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.step_key, self.attached, self.shared = STEP_KEY, False, None
        wdir = dir or os.environ.get("WANDB_DIR") or (str(self.run_dir) if self.run_dir else None)
        if wdir:
            Path(wdir).mkdir(parents=True, exist_ok=True)
        self._require_login(init.get("mode"))
        self.run = self.wandb.init(dir=wdir, **init)
        if cancel is not None and not cancel.claim():  # created after finish() gave up: nobody will log here
            self.run.finish(exit_code=EXIT_CODE["killed"])
            raise RuntimeError("opening the W&B run was cancelled: finish() gave up waiting for it")
        self.run.define_metric(STEP_KEY)
        self.run.define_metric("*", step_metric=STEP_KEY)
        self._step = -1  # the W&B step of the last log call
        self._tables: dict[str, tuple[list[str], list[list[Any]]]] = {}
        self._init_args = {k: init.get(k) for k in ("project", "entity", "mode")} | {"dir": wdir}
        self._record()

    def _note_run(self, **facts: Any) -> None:
        """``facts`` about the run into our file in its files (``naming.RUN_FILE``, uploaded with them): what the
        report and the ledger read from a W&B folder offline. A failure costs them that, never the run."""
        notes = self.__dict__.setdefault("_notes", {})
        notes.update(facts)
        files = getattr(self.run, "dir", None)
        if getattr(self.run, "disabled", False) or not files or not Path(files).is_dir():
            return  # WANDB_MODE=disabled: no files to note anything in, and no folder to read them from
        try:
            atomic_write_json(Path(files) / RUN_FILE, notes)  # a kill mid-write leaves the old notes, not half
        except (OSError, TypeError, ValueError) as exc:
            if not self.__dict__.get("_note_warned"):
                self._note_warned = True
                warnings.warn(f"gradloc-track: could not write {RUN_FILE} into the W&B run's files ({exc!r}); "
                              "`gradloc-track report` / `culprits` read less of the run from its W&B folder alone",
                              stacklevel=3)

    def _record(self) -> None:
        """The run's ``view`` in the run dir's record (its files' folder, path, link)."""
        run, files = self.run, getattr(self.run, "dir", None)
        record_run(self.run_dir, "wandb", {"dir": str(Path(files).parent) if files else None,
                                           "path": getattr(run, "path", None),
                                           "url": getattr(run, "url", None), "run_name": getattr(run, "name", None),
                                           "offline": bool(getattr(run, "offline", False))})

    def where(self) -> str:
        """One line saying where this run is: its name and link (offline: its files and how to upload them)."""
        # an offline run has no name until it is synced (W&B gives it one then): its id says which it is
        name = repr(self.run.name) if self.run.name else f"(id {self.run.id}, named when synced)"
        if getattr(self.run, "offline", False):
            folder = Path(self.run.dir).parent
            return f"W&B offline run {name} in {folder} (upload: wandb sync {folder})"
        return f"W&B run {name}: {self.run.url}"

    def run_ref(self) -> dict[str, Any]:
        """What ``replay`` needs to find this run again."""
        return {"run_id": self.run.id, **self._init_args}

    def _log(self, data: dict[str, Any], step: int | None, media: bool = False) -> None:
        if self.shared is not None:  # the user's own run: their rows, their step (media: a lane of their own)
            self._step = max(self._step, -1 if step is None else int(step))
            self.shared.log(data, None if step is None else int(step), media)
            return
        if step is None:
            self.run.log(data)
            return
        step = int(step)
        if self.attached:  # the owner drives W&B's own step; ours rides along as step_key
            self.run.log({self.step_key: step, **data})
            self._step = max(self._step, step)
        elif step >= self._step:
            self.run.log({self.step_key: step, **data}, step=step)
            self._step = step
        else:  # W&B only appends: keep the record, at the latest step (rather than have W&B drop it)
            self.run.log(data, step=self._step)

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self._log(dict(metrics), step)

    def log_metric_records(self, records: Sequence[tuple[Mapping[str, float], int, int]]) -> None:
        """Many ``(metrics, step, timestamp_ms)`` records in one call (the writer's batch, replay): each
        step is still its own row; W&B stamps its own time (``_timestamp``)."""
        for metrics, step, _ts in records:
            self._log(dict(metrics), step)

    def log_params(self, params: Mapping[str, Any]) -> None:
        self.run.config.update(dict(params), allow_val_change=True)
        self._note_run(params={**self.__dict__.get("_notes", {}).get("params", {}), **dict(params)})

    def log_table(self, key, columns, rows, step=None) -> None:
        rows = [list(r) for r in rows]
        cols, all_rows = self._tables.setdefault(key, (list(columns), []))
        if list(columns) == cols:
            all_rows.extend(rows)
        self._log({key: self._table(list(columns), rows)}, step, media=True)
        self._tell_story(key, columns, rows)

    def _tell_story(self, key, columns, rows) -> None:
        """The run summary's ``spike_summary``: the spikes so far with their culprit text and where each
        one's highlighted text is (``spike_story``), on the run's overview page."""
        story = self.__dict__.setdefault("_story", SpikeStory())
        if not story.add(key, columns, rows):
            return
        url = None if getattr(self.run, "offline", False) else getattr(self.run, "url", None)
        where = f"{url} (the spikes/highlight panel)" if url else "the spikes/highlight panel"
        try:
            self.run.summary["spike_summary"] = f"{story.text()}\nhighlighted text: {where}"
        except Exception:  # noqa: BLE001 - a view of the tables just logged, never the record
            pass

    def _table(self, columns: list[str], rows: list[list[Any]]) -> Any:
        return self.wandb.Table(columns=columns, data=rows, allow_mixed_types=True)

    def log_html(self, key, html, step=None) -> None:
        self._log({key: self.wandb.Html(html, inject=False)}, step, media=True)

    def log_image(self, key, path, step=None) -> None:
        self._log({key: self.wandb.Image(str(path))}, step, media=True)

    def log_artifact(self, path, artifact_path=None) -> None:
        path = Path(path)
        if path.name in RESERVED_FILES:  # W&B writes its own run config as config.yaml: do not clash
            own = Path(self.run.dir) / f"gradloc-{path.name}"  # files in run.dir are the run's files
            shutil.copyfile(path, own)
            self.run.save(str(own), base_path=self.run.dir, policy="now")
            return
        self.run.save(str(path), base_path=str(path.parent), policy="now")

    def set_tags(self, tags: Mapping[str, str]) -> None:
        for k, v in tags.items():
            if k != "spike_count":  # a number in the history (the artifact writer logs it at each spike's step); the
                self.run.summary[k] = v  # summary's string "12" sorted before "2" (held-out tester, stop 64)
        self.run.tags = tuple(sorted(set(self.run.tags or ()) | {f"{k}:{v}" for k, v in tags.items()
                                                                  if k != "spike_count"} |
                                     ({"spikes"} if "spike_count" in tags and str(tags["spike_count"]) != "0"
                                      else set())))

    def finish(self, status: str = "success", timeout_s: float | None = None) -> None:
        """Log the cumulative tables, then end the run we opened (not one we joined); ``AsyncTracker`` bounds it."""
        last = None if self.shared is not None else max(self._step, 0)  # (the user's run: in any row)
        for key, (cols, rows) in self._tables.items():
            if rows:  # the whole table once, logged with the last step
                self._log({f"{key}_all": self._table(cols, rows)}, last, media=True)
        if self.shared is not None:
            self.shared.finish()
        if self.attached:  # never finish a run we did not open
            return
        self.run.finish(exit_code=EXIT_CODE.get(status, 1))
