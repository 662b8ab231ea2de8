"""The one place a run of ours is opened, or joined when someone else already opened it.

Callers: ``make_tracker`` (the run a ``TrackerConfig`` describes: ``open_run``), and every front
door (``watch()``, the HF / TRL / Lightning callbacks, through ``integrations.handle``), which
call ``start``: join the runs already open, else open one.

- ``open_run``: a new run of the backend ``tracker.kind`` names (``both``: MLflow and W&B), each
  opened by its entry in ``backends.BACKENDS`` behind the background writer (``AsyncTracker``),
  finished as KILLED on SIGTERM; ``tracker=none`` with a run dir: the run dir's files; ``memory``.
- ``join_runs``: into runs someone else opened (``OpenRuns``: what each backend's
  ``open_in_process`` finds, ``wandb.run`` / ``mlflow.active_run()``; HF Trainer's ``report_to``
  run, Lightning's logger runs), through the same background writer; they stay open at finish.

Every backend run, opened or joined, is recorded in ``<run dir>/tracker/<backend>.json``
(``run_record``): the ``spec`` here, the ``view`` (MLflow run / W&B path and folder) by the
adapter as soon as the run exists. So ``gradloc-track report <run dir>``, ``culprits`` and the
console follow a run dir to its run, joined or not.

The run dir (``RunDir``): the user's, kept; else a scratch directory, made on first use and
removed when the run ends (by the run lock's release, or ``Run.close``), unless its spool holds
records for ``gradloc-track replay`` (then kept, and named). A scratch dir is never shown to a
person as a run dir (``is_scratch``): the run's link is.
"""
from __future__ import annotations

import logging
import shutil
import tempfile
import uuid
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import TrackerConfig
from . import sigterm
from .backends import BACKENDS, OnOpen
from .fanout import as_one_tracker
from .interface import NullTracker, Tracker
from .local_tracker import LocalTracker
from .memory_tracker import MemoryTracker
from .run_lock import RunOwner

log = logging.getLogger(__name__)

#: what ``tracker=both`` opens
BOTH = ("mlflow", "wandb")

_scratch: set[Path] = set()  # the scratch dirs of this process that still exist


def is_scratch(path: str | Path) -> bool:
    """True for a scratch dir of this process (removed when its run ends): never print it as a run dir."""
    return Path(path) in _scratch


class RunDir:
    """Where a run's own files go (run record, spool, rendered images): ``path`` given (the user's,
    kept), or a scratch directory made on first use and removed by ``remove()`` (or by the run
    lock when its last tracker finishes) unless records the backend did not take are spooled there."""

    def __init__(self, path: str | Path | None = None) -> None:
        self.given = path is not None
        self._path = Path(path) if path is not None else None
        self._gone: Path | None = None  # the scratch dir ``remove()`` took away with its run
        self.owner = RunOwner(temporary=not self.given)  # the trackers of one run share its lock
        self.same_run: str | None = None  # the identity its backend runs share (``naming.SAME_RUN_TAG``), when several

    @property
    def path(self) -> Path:
        if self._path is None:
            if self._gone is not None:  # read after its run ended (``closing_lines(..., handle.run_dir)``): the
                return self._gone  # one it was, not a new one nobody removes (held-out tester, stop 57)
            self._path = Path(tempfile.mkdtemp(prefix="gradloc-track-"))
            _scratch.add(self._path)
        return self._path

    @property
    def kept(self) -> Path | None:
        """The directory when it outlives the run (the user's), else None."""
        return self._path if self.given else None

    def spooled(self) -> list[Path]:
        """Spool files holding records (what ``gradloc-track replay`` would send)."""
        if self._path is None:
            return []
        return [p for p in (self._path / "spool").glob("*.jsonl") if p.is_file() and p.stat().st_size > 0]

    def remove(self) -> None:
        """A scratch dir goes (a given one stays); kept, and named, while its spool holds records."""
        if self.given or self._path is None:
            return
        if self._path.exists() and self.spooled():
            log.warning("gradloc-track: keeping %s: %d spool file(s) hold records the backend did not take; "
                        "send them with `gradloc-track replay %s`", self._path, len(self.spooled()), self._path)
            return
        shutil.rmtree(self._path, ignore_errors=True)
        self._gone, self._path = self._path, None  # still scratch: never shown as a place to look


class OpenRuns:
    """Runs someone else opened, to log into and leave open: ``OpenRuns(mlflow=(run_id, tracking_uri))``,
    ``OpenRuns(wandb=run)``, one keyword per backend (``backends.BACKENDS``: what its ``open_in_process``
    finds). ``wandb_step_key``: the step metric of the framework that opened the run (HF Trainer's,
    Lightning's); None: the user's own run (for W&B, our records in their rows, ``wandb_shared``)."""

    def __init__(self, wandb_step_key: str | None = None, **runs: Any) -> None:
        unknown = sorted(set(runs) - set(BACKENDS))
        if unknown:
            raise TypeError(f"OpenRuns: no backend named {', '.join(unknown)} (known: {', '.join(BACKENDS)})")
        self.runs = {name: runs[name] for name in BACKENDS if runs.get(name) is not None}
        self.wandb_step_key = wandb_step_key

    def __getattr__(self, name: str) -> Any:
        if name != "runs" and name in BACKENDS:  # ``found.mlflow``: that backend's run, or None
            return self.runs.get(name)
        raise AttributeError(name)

    @property
    def backends(self) -> tuple[str, ...]:
        return tuple(self.runs)


def open_in_process(wandb_step_key: str | None = None) -> OpenRuns:
    """The run each backend has open in this process (``wandb.run`` / ``mlflow.active_run()``), only if this
    process already imported that SDK (never imported here to look)."""
    return OpenRuns(wandb_step_key, **{name: b.open_in_process() for name, b in BACKENDS.items()})


def open_run(cfg: TrackerConfig, place: RunDir, run_name: str | None = None, on_open: OnOpen | None = None
             ) -> Tracker:
    """A new run as ``cfg`` describes it, finished as KILLED on SIGTERM (one that writes somewhere)."""
    tracker = _open(cfg, place, run_name or cfg.run_name, on_open)
    if not isinstance(tracker, (NullTracker, MemoryTracker)):
        sigterm.guard(tracker)
    return tracker


def _open(cfg: TrackerConfig, place: RunDir, name: str | None, on_open: OnOpen | None) -> Tracker:
    if cfg.kind == "none":
        return LocalTracker(place.kept, finish_timeout_s=cfg.finish_timeout_s) if place.given else NullTracker()
    if cfg.kind == "memory":
        return MemoryTracker(place.kept)
    chosen = [BACKENDS[k] for k in (BOTH if cfg.kind == "both" else (cfg.kind,)) if k in BACKENDS]
    if not chosen:
        raise ValueError(f"tracker.kind={cfg.kind!r} is unknown: use one of none, memory, both, {', '.join(BACKENDS)}")
    for backend in chosen:  # every package there before a writer holds the run dir
        backend.require()
    if len(chosen) > 1:  # one run, several backend runs: each records the identity they share
        place.same_run = uuid.uuid4().hex
    return as_one_tracker([b.open(cfg, place, name, on_open) for b in chosen])


def join_runs(runs: OpenRuns, cfg: TrackerConfig, place: RunDir, on_open: OnOpen | None = None) -> Tracker | None:
    """A tracker into every run of ``runs`` (None when there is none); the runs stay open at finish."""
    return as_one_tracker([BACKENDS[name].join(found, runs.wandb_step_key, cfg, place.path, place.owner, on_open)
                           for name, found in runs.runs.items()])


@dataclass(frozen=True)
class RunRequest:
    """What a front door asks for. ``tracker``: the caller's own ``Tracker``, used as is (never
    finished here); ``auto``: join the runs already open (``join``: the framework's, else those
    of this process, with ``wandb_step_key``), else open what ``cfg`` says; ``logs=False``: a rank
    that does not log (a ``NullTracker``)."""

    cfg: TrackerConfig = field(default_factory=TrackerConfig)
    run_dir: str | Path | None = None
    run_name: str | None = None
    tracker: Tracker | None = None
    auto: bool = True
    join: OpenRuns | None = None
    wandb_step_key: str | None = None
    logs: bool = True
    on_open: OnOpen | None = None


@dataclass
class Run:
    """A run of ours: its tracker, its directory, which backend runs it joined (left open)."""

    tracker: Tracker
    dir: RunDir
    joined: tuple[str, ...] = ()
    owned: bool = True  # False: the caller's Tracker, only flushed here

    @property
    def kept_dir(self) -> Path | None:
        """The run dir a person can read after the run (the user's); None when it is scratch."""
        return self.dir.kept

    def close(self, status: str = "success") -> None:
        """Finish the tracker (a joined backend run stays open; the caller's tracker is flushed), then
        remove a scratch dir. Never raises: logging must not kill training."""
        try:
            if self.owned:
                self.tracker.finish(status)
            else:
                self.tracker.flush()
        except Exception as exc:  # noqa: BLE001
            warnings.warn(f"gradloc-track: finishing the tracker failed: {exc!r}")
        self.dir.remove()


def start(req: RunRequest) -> Run:
    """Join what is open, else open what ``req.cfg`` says (see ``RunRequest``)."""
    place = RunDir(req.run_dir)
    if not req.logs:
        return Run(NullTracker(), place)
    if req.tracker is not None:
        return Run(req.tracker, place, owned=False)
    if req.auto:
        runs = req.join if req.join is not None and req.join.backends else open_in_process(req.wandb_step_key)
        joined = join_runs(runs, req.cfg, place, req.on_open)
        if joined is not None:
            return Run(joined, place, joined=runs.backends)
        if req.cfg.kind == "none" and req.run_dir is None:
            log.info("gradloc-track: no open W&B/MLflow run and tracker='none': metrics stay in handle.last; "
                     "pass tracker='mlflow'|'wandb' or open a run first")
    return Run(open_run(req.cfg, place, req.run_name, req.on_open), place)
