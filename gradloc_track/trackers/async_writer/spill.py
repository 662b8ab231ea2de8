"""Records the backend did not take go to the spool, with one warning per kind of trouble.

The spool file holds every record; the warnings only say where it is and how to replay it.
"""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import Callable

from ..interface import ARTIFACT_CALLS, Tracker
from ..spool import Spool
from .jobs import JobSink, run_job


class Spill:
    def __init__(self, spool: Spool, name: str, run_dir: Path) -> None:
        self.spool, self.name, self.run_dir = spool, name, run_dir
        self._warned: set[str] = set()
        self.first_error: str | None = None  # why the first record was spooled (the closing lines say it)
        self.artifact_location: str | None = None  # the artifact store that did not take a write, when known
        self.others = 0  # records spooled that are no spike files (``ARTIFACT_CALLS``): metrics, tags, the status

    def __call__(self, call: str, args: tuple, ts: int, error: str, artifacts: bool = False) -> None:
        """Spool the record; ``artifacts``: only the backend's artifact store refused it (the warning says so)."""
        if self.first_error is None:
            self.first_error = error
        if call not in ARTIFACT_CALLS:
            self.others += 1
        if call == "log_metric_records":  # a batch of steps: one spool line per step, with its own time
            for metrics, step, step_ts in args[0]:
                self.spool.write("log_metrics", (metrics, step), error, ts=step_ts)
        else:
            self.spool.write(call, args, error, ts=ts)
        if artifacts:
            at = f" at {self.artifact_location}" if self.artifact_location else ""
            self.warn_once("artifacts", f"gradloc-track: the {self.name} tracker's artifact store{at} did not take a "
                           f"write ({error}): the spike tables, highlight pages and images are kept in "
                           f"{self.spool.path}; metrics, params and the run's status go on. Fix the store (its "
                           "folder's or bucket's write permission, the server's --artifacts-destination), then send "
                           "them with "
                           f"`gradloc-track replay {self.run_dir}`")
        else:
            self.warn_down(error)

    def warn_down(self, error: str) -> None:
        self.warn_once("down", f"gradloc-track: the {self.name} tracker failed ({error}); records are kept in "
                       f"{self.spool.path} (replay with `gradloc-track replay {self.run_dir}`)")

    def run_job(self, job: Callable[[Tracker], None], reason: str, ts: int) -> None:
        """Run ``job`` here with every record it logs going to the spool (``reason``: why not the backend)."""
        def deliver(call: str, args: tuple, ts: int) -> bool:
            self(call, args, ts, reason)
            return False
        run_job(job, JobSink(deliver, ts), self.name)

    def warn_once(self, what: str, message: str) -> None:
        if what not in self._warned:  # once per kind; the spool file holds every record
            self._warned.add(what)
            warnings.warn(message, RuntimeWarning, stacklevel=3)
