"""``Backend``: everything the library does per tracker backend, as one entry.

A backend (MLflow, W&B, TensorBoard) is one subclass of ``Backend`` in one file of this package;
defining it registers it (``BACKENDS``), and every place that does something per backend loops over
the registry instead of naming backends:

- ``open``: a new run behind the background writer (``trackers.join.open_run``);
- ``open_in_process`` / ``join``: the run this process already has open, and logging into it
  (``trackers.join``: ``watch()``, the HF / Lightning / TRL callbacks); ``from_lightning``: a Lightning
  logger's run;
- ``resume`` / ``end_if_orphaned``: the original run again (``gradloc-track replay``);
- ``is_run_folder`` / ``run_id``: a folder of the backend's own that is a run dir, and a run's
  identity (``run_dirs``);
- ``report_files`` / ``find_run``: where the report and the ledger read a run's spike files
  (``report``, ``ledger.sources``);
- ``where`` / ``page_link`` / ``commands``: the links and commands the console prints (``console.links``);
- ``closing_hint``: what the closing lines add when the backend did not receive everything
  (``async_writer.closing``).

Each method has a do-nothing default, so a backend overrides what it supports. Nothing here imports
a backend's SDK: the entries load it when they open or read a run.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ClassVar

from ..interface import Tracker

if TYPE_CHECKING:
    from ...config import TrackerConfig
    from ..join import RunDir

#: name -> backend, in the order of ``Backend.rank`` (a run's identity prefers the first)
BACKENDS: dict[str, "Backend"] = {}
#: called once per backend when its run exists (e.g. to say where the run is)
OnOpen = Callable[[Tracker], None]


class ReportSourceError(FileNotFoundError):
    """The report source is neither a run directory with ``spikes/`` nor a readable run of a backend."""


class NoSpikeEvents(ReportSourceError):
    """A run (dir, W&B folder or MLflow run) that exists and logged no spike event."""


class SpikeReader:
    """A run's spike files in a backend's own layout (W&B's media, TensorBoard's event files), as bytes:
    the report parses them (its notes say what was damaged). The shared layout (``spikes/...``) needs none."""

    def tables(self, kind: str) -> list[tuple[str, bytes]]:
        """Table ``spikes/<kind>`` (``tokens`` | ``events``): ``(name, JSON document)`` per part, in step order."""
        return []

    def pages(self) -> dict[int, bytes]:
        """step -> the spike's highlight page (a whole HTML document)."""
        return {}

    def images(self) -> dict[int, bytes]:
        """step -> the spike's heatmap (PNG)."""
        return {}


@dataclass
class RunFiles:
    """Where a run's spike files are (``root`` holds ``spikes/``, unless ``reader`` reads them in the
    backend's own layout), its title, a link back to the run, and which run it is (``run_dirs.run_key``)."""

    root: Path
    title: str
    link: str | None = None
    run_id: str = ""  # the MLflow run id, wandb:<id>, else the run dir's resolved path
    temporary: bool = False  # ``root`` is a download of ours: removed once read
    reader: SpikeReader | None = None
    notes: list[str] = field(default_factory=list)
    aliases: tuple[str, ...] = ()  # the run's other identities (``run_dirs.run_keys``: another backend's run id)


class Backend:
    """One tracker backend (see the module doc). ``name``: ``tracker.kind``, and the name of its run
    record (``<run dir>/tracker/<name>.json``) and spool; ``title``: how people call it; ``extra``: the
    install extra its SDK comes with; ``rank``: its place in the registry."""

    name: ClassVar[str] = ""
    title: ClassVar[str] = ""
    extra: ClassVar[str] = ""
    rank: ClassVar[int] = 100

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.__dict__.get("name"):
            BACKENDS[cls.name] = cls()
            ordered = sorted(BACKENDS.values(), key=lambda b: b.rank)
            BACKENDS.clear()
            BACKENDS.update((b.name, b) for b in ordered)

    def require(self) -> None:
        """Fail fast, on the caller's thread, when the SDK is missing (an ImportError naming the extra)."""
        from ..._optional import require

        require(self.extra or self.name, self.extra or self.name)

    # -- a run of ours ---------------------------------------------------------------------------
    def open(self, cfg: "TrackerConfig", place: "RunDir", run_name: str | None, on_open: OnOpen | None) -> Tracker:
        """A new run, behind the background writer (``AsyncTracker``), its records kept in ``place.path``
        (the run dir: the user's, ``place.kept``, or a scratch one removed when the run ends)."""
        raise NotImplementedError(f"tracker.kind={self.name}: this backend cannot open a run")

    # -- a run someone else opened ---------------------------------------------------------------
    def open_in_process(self) -> Any:
        """The run this process already has open (``wandb.run``), or None; never imports the SDK to look."""
        return None

    def from_lightning(self, logger: Any) -> Any:
        """The run of a Lightning logger of this backend (``MLFlowLogger``), or None."""
        return None

    def join(self, found: Any, step_key: str | None, cfg: "TrackerConfig", run_dir: Path, owner: Any,
             on_open: OnOpen | None) -> Tracker:
        """A tracker into ``found`` (what ``open_in_process``/``from_lightning`` found), left open at finish.
        ``step_key``: the step metric of the framework that opened it (None: the user's own run)."""
        raise NotImplementedError(f"{self.title}: a run opened elsewhere cannot be joined")

    # -- replay ------------------------------------------------------------------------------------
    def resume(self, run_dir: Path, run: dict[str, Any], spec: dict[str, Any],
               tracking_uri: str | None) -> Tracker:
        """The original run (``run``: its recorded reference), or one made from ``spec`` when it never existed."""
        raise NotImplementedError(f"{run_dir}: cannot replay a spool for backend {self.name!r}; "
                                  "pass a tracker to replay_spool(path, tracker)")

    def end_if_orphaned(self, tracker: Tracker) -> bool | None:
        """End a run whose process died as KILLED if the backend still shows it running (True: ended);
        None: the backend marks such a run by itself (W&B), or has no run state (TensorBoard)."""
        return None

    # -- run dirs ----------------------------------------------------------------------------------
    def is_run_folder(self, path: Path) -> bool:
        """Whether ``path`` is a folder of this backend's own that counts as a run dir (W&B's offline-run-*)."""
        return False

    def run_id(self, run_dir: Path, where: dict[str, Any] | None) -> str | None:
        """The identity of the run ``run_dir`` logged to (``where``: its view, if recorded), or None."""
        return None

    def same_run(self, folder: Path) -> str | None:
        """The identity a run folder of this backend's own shares with its sibling backend run (``tracker=both``:
        ``naming.SAME_RUN_KEY`` + the id it recorded), or None."""
        return None

    def run_params(self, folder: Path) -> dict[str, Any]:
        """The params a run folder of this backend's own recorded (``log_params``); {} when none."""
        return {}

    # -- the report and the ledger -------------------------------------------------------------------
    def report_files(self, run_dir: Path, where: dict[str, Any] | None, tracking_uri: str | None) -> RunFiles | None:
        """Where the report reads the spike files of the run ``run_dir`` logged to (``where``: its view)
        when the run dir has no ``spikes/`` of its own; None when this backend holds none."""
        return None

    def find_run(self, text: str, tracking_uri: str | None) -> RunFiles | None:
        """A run named by an id (not a path), e.g. an MLflow run id; None when ``text`` is none of this backend's."""
        return None

    def link(self, where: dict[str, Any]) -> str | None:
        """The run's own page (the report links back to it)."""
        return None

    # -- the console -------------------------------------------------------------------------------
    def where(self, view: dict[str, Any], page: str | None) -> list[str]:
        """Lines saying where the run is (``page``: a file of its spikes to open, e.g. a highlight page)."""
        return []

    def page_link(self, view: dict[str, Any], page: str) -> str | None:
        """A link straight to ``page`` (``spikes/highlight/step_*.html``) of the run, when the backend has one."""
        return None

    def commands(self, view: dict[str, Any]) -> list[str]:
        """The commands that open the run (each line indented two spaces, a comment saying what it does)."""
        return []

    def closing_hint(self, run_dir: Path, error: str | None) -> list[str] | None:
        """Lines replacing the plain replay command when records are spooled (W&B without a login), or None."""
        return None

