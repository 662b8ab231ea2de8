"""The culprit ledger: every spike event of many runs in one table, per sample and per group.

``gradloc-track culprits <experiment | run dirs | W&B run dirs>...`` (``command``) reads each run's
culprit table (``sources``, its rows checked by ``rows``), aggregates it (``aggregate``), writes
CSV/JSON/HTML (``render``), and can export a blocklist (``export``, for ``gradloc_track.data``) and
log itself to a tracker (``publish``). See docs/ledger.md. The names below resolve on first use, so
``gradloc-track culprits --help`` imports none of the readers.
"""
from __future__ import annotations

from .._lazy import lazy_names

_EXPORTS = {
    "Ledger": "gradloc_track.ledger.aggregate",
    "Views": "gradloc_track.ledger.aggregate",
    "by_group": "gradloc_track.ledger.aggregate",
    "by_sample": "gradloc_track.ledger.aggregate",
    "collect": "gradloc_track.ledger.aggregate",
    "views": "gradloc_track.ledger.aggregate",
    "export_blocklist": "gradloc_track.ledger.export",
    "RunTable": "gradloc_track.ledger.sources",
    "read_runs": "gradloc_track.ledger.sources",
}
__all__ = sorted(_EXPORTS)

__getattr__ = lazy_names(__name__, _EXPORTS)
