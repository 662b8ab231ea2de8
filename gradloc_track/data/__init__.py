"""From ledger to data: leave the samples a ledger blamed out of the next run.

``load_blocklist(FILE)`` reads what ``gradloc-track culprits --export-blocklist FILE`` wrote;
``filter_dataset`` drops its samples from an HF ``datasets.Dataset``, ``BlockedDataset`` /
``BlockedIterableDataset`` from torch datasets, each with a count of the drops. ``Quarantine``
skips, within a run, a sample already blamed when it comes again (``spikes.quarantine=true``).
See docs/ledger.md. The names resolve on first use: the blocklist (``culprits --export-blocklist``)
needs no torch, the torch wrappers do.
"""
from __future__ import annotations

from .._lazy import lazy_names

_EXPORTS = {
    "Blocklist": "gradloc_track.data.blocklist",
    "BlocklistError": "gradloc_track.data.blocklist",
    "load_blocklist": "gradloc_track.data.blocklist",
    "write_blocklist": "gradloc_track.data.blocklist",
    "BlockedDataset": "gradloc_track.data.filters",
    "BlockedIterableDataset": "gradloc_track.data.filters",
    "filter_dataset": "gradloc_track.data.filters",
    "record_fingerprint": "gradloc_track.data.fingerprint",
    "Quarantine": "gradloc_track.data.quarantine",
    "logging_quarantine": "gradloc_track.data.quarantine",
}
__all__ = sorted(_EXPORTS)

__getattr__ = lazy_names(__name__, _EXPORTS)
