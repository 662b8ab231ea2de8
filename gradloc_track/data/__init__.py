"""From ledger to data: leave the samples a ledger blamed out of the next run.

``load_blocklist(FILE)`` reads what ``gradloc-track culprits --export-blocklist FILE`` wrote;
``filter_dataset`` drops its samples from an HF ``datasets.Dataset``, ``BlockedDataset`` /
``BlockedIterableDataset`` from torch datasets, each with a count of the drops. ``Quarantine``
skips, within a run, a sample already blamed when it comes again (``spikes.quarantine=true``).
See docs/ledger.md.
"""
from .blocklist import Blocklist, BlocklistError, load_blocklist, write_blocklist
from .filters import BlockedDataset, BlockedIterableDataset, filter_dataset
from .fingerprint import record_fingerprint
from .quarantine import Quarantine, logging_quarantine

__all__ = ["Blocklist", "BlocklistError", "BlockedDataset", "BlockedIterableDataset", "Quarantine",
           "filter_dataset", "load_blocklist", "logging_quarantine", "record_fingerprint", "write_blocklist"]
