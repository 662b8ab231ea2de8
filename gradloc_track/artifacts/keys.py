"""The tracker keys the spike artifacts are logged under: one name for the writer and for every reader
(the report, the ledger, the run page's story, the backends' readers). Torch-free."""
from __future__ import annotations

EVENTS_KEY = "spikes/events"  # one row per detected spike (``events.py``)
TABLE_KEY = "spikes/tokens"  # one row per culprit: the attribution table (``table.py``)
HTML_KEY = "spikes/highlight"  # the highlighted text (``highlight.py``)
IMAGE_KEY = "spikes/heatmap"  # the per-layer heatmap (``heatmap.py``)
