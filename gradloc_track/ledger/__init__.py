"""The culprit ledger: every spike event of many runs in one table, per sample and per group.

``gradloc-track culprits <experiment | run dirs | W&B run dirs>...`` (``command``) reads each run's
culprit table (``sources``), aggregates it (``aggregate``), writes CSV/JSON/HTML (``render``), and
can export a blocklist (``export``, for ``gradloc_track.data``) and log itself to a tracker
(``publish``). See docs/ledger.md.
"""
from .aggregate import Ledger, by_group, by_sample, collect
from .export import export_blocklist
from .sources import RunTable, read_runs

__all__ = ["Ledger", "RunTable", "by_group", "by_sample", "collect", "export_blocklist", "read_runs"]
