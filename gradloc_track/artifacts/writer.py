"""Send a localized spike to the tracker: table rows, highlighted HTML, heatmaps, tags."""
from __future__ import annotations

import tempfile
import warnings
from pathlib import Path
from typing import Any, Sequence

from ..locate.result import LocateResult
from ..spikes.event import SpikeEvent
from ..trackers.base import Tracker
from .heatmap import render_layer_heatmap
from .highlight import render_highlight_html
from .table import attribution_table

TABLE_KEY = "spikes/tokens"
HTML_KEY = "spikes/highlight"
IMAGE_KEY = "spikes/heatmap"


class SpikeArtifactWriter:
    """``write(step, events, result, ctx)``; never raises into training (warns instead).

    The table's columns are fixed at the first event (extra columns absent later are None), so
    the one growing table per run stays valid.
    """

    def __init__(self, tracker: Tracker, run_dir: str | Path | None = None, top_layers: int = 3,
                 images: bool = True) -> None:
        self.images = images
        self.tracker = tracker
        self.run_dir = Path(run_dir) if run_dir is not None else Path(tempfile.mkdtemp(prefix="gradloc-spikes-"))
        self.top_layers = top_layers
        self.events = 0
        self._extra: list[str] | None = None
        self._sample: list[str] | None = None

    def write(self, step: int, events: Sequence[SpikeEvent], result: LocateResult, ctx: Any) -> None:
        try:
            self._write(step, events, result, ctx)
        except Exception as exc:
            warnings.warn(f"gradloc-track: could not write spike artifacts for step {step}: {exc!r}")

    def _write(self, step, events, result, ctx) -> None:
        if self._extra is None:
            self._extra = list(getattr(ctx, "extra_columns", {}) or {})
            self._sample = list(getattr(ctx, "sample_columns", {}) or {})
        columns, rows = attribution_table(step, events, result, ctx, self.top_layers, self._extra, self._sample)
        self.events += 1
        if rows:
            self.tracker.log_table(TABLE_KEY, columns, rows, step)
        if getattr(ctx, "input_ids", None) is not None:
            self.tracker.log_html(HTML_KEY, render_highlight_html(step, events, result, ctx), step)
            samples = sorted({c.batch for c in result.tokens})
            if samples and self.images:
                png = render_layer_heatmap(result, ctx, samples[0],
                                           self.run_dir / "rendered" / f"heatmap_step_{step:06d}.png")
                if png is not None:
                    self.tracker.log_image(IMAGE_KEY, png, step)
        self.tracker.set_tags({"spike_count": str(self.events)})
        self.tracker.log_metrics({"spike/culprits": float(len(result.tokens)),
                                  "spike/culprit_share": float(sum(c.share or 0.0 for c in result.tokens))}, step)
