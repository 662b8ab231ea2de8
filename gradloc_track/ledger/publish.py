"""Log a ledger to a tracker as its own run (``--log-to mlflow|wandb``), through the library's trackers.

One run named ``culprit-ledger``: table ``ledger/samples`` (one row per blamed sample; MLflow:
``ledger/samples/step_000000.json``, W&B: a table panel), table ``ledger/by_<column>`` with
``--by``, the HTML page as artifact, the sources and counts as params. The tracker's own run
directory (its ``tracker/<backend>.json`` says where the run went, its ``spool/`` holds what was not
delivered) is ``<out>/ledger_run`` (``ledger_run-2``, ... when that one exists: never a previous
ledger's record or spool).

The wait is bounded by OUR timeouts (``Destination.timeout_s`` for opening the run and for
finishing; the SDKs keep their own retries): a server that is down costs at most that, and what
was not delivered stays in the spool. ``Delivery.delivered`` says whether everything arrived; the
command fails loudly when it did not, naming ``gradloc-track replay <run dir>``.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from ..config import TrackerConfig
from ..config.tracker import MlflowConfig, WandbConfig
from ..trackers.spool import read_spool
from .aggregate import Views
from .render import as_rows

TABLE_KEY = "ledger/samples"
RUN_DIR = "ledger_run"


@dataclass
class Destination:
    """Where ``--log-to`` sends the ledger, and how long we wait for it (seconds, ours)."""

    backend: str
    tracking_uri: str | None = None
    experiment: str = "gradloc-track"
    project: str = "gradloc-track"
    run_name: str = "culprit-ledger"
    timeout_s: float = 60.0

    def config(self) -> TrackerConfig:
        t = float(self.timeout_s)
        return TrackerConfig(kind=self.backend, run_name=self.run_name, open_timeout_s=t, finish_timeout_s=t,
                             call_timeout_s=min(10.0, t),
                             mlflow=MlflowConfig(tracking_uri=self.tracking_uri, experiment_name=self.experiment),
                             wandb=WandbConfig(project=self.project))


@dataclass
class Delivery:
    """What became of the ledger run: where it is (``{backend: view}``), what is still in the spool."""

    run_dir: Path
    where: dict[str, Any]
    spooled: int

    @property
    def delivered(self) -> bool:
        return bool(self.where) and self.spooled == 0


def fresh_run_dir(out_dir: str | Path) -> Path:
    """``<out>/ledger_run``, or the first ``ledger_run-N`` not taken."""
    base = Path(out_dir) / RUN_DIR
    n = 1
    while (base if n == 1 else base.with_name(f"{RUN_DIR}-{n}")).exists():
        n += 1
    return base if n == 1 else base.with_name(f"{RUN_DIR}-{n}")


def log_ledger(v: Views, out_dir: str | Path, sources: Sequence[str], dest: Destination) -> Delivery:
    """Log the ledger as one run of ``dest.backend``; what was delivered, what is spooled."""
    from ..run_dirs import run_locations
    from ..trackers import make_tracker

    run_dir = fresh_run_dir(out_dir)
    tracker = make_tracker(dest.config(), run_dir=run_dir)
    status = "failed"
    try:
        led = v.ledger
        tracker.log_params({"ledger.sources": ", ".join(map(str, sources)), "ledger.runs": len(led.runs),
                            "ledger.spike_events": led.events, "ledger.samples": len(v.samples),
                            **({"ledger.by": v.by} if v.by else {})})
        if v.samples:
            tracker.log_table(TABLE_KEY, *as_rows(v.samples))
        if v.by is not None and v.groups:
            tracker.log_table(f"ledger/by_{v.by}", *as_rows(v.groups))
        page = Path(out_dir) / "culprits.html"
        if page.is_file():
            tracker.log_artifact(page, "ledger")
        status = "success"
    finally:
        tracker.finish(status)
    spool = run_dir / "spool" / f"{dest.backend}.jsonl"
    where = {k: w for k, w in run_locations(run_dir).items() if k == dest.backend}
    return Delivery(run_dir, where, len(read_spool(spool)) if spool.is_file() else 0)
