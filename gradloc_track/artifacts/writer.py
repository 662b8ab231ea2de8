"""Send a localized spike to the tracker: table rows, highlighted HTML, heatmap, tags, metrics."""
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
    """``write(step, events, result, ctx)`` for each localized spike; never raises into training.

    Per event it logs, with the tracker's file layout (see ``trackers/base.py``):
    - table ``spikes/tokens``: one row per culprit, appended to ONE growing table per run;
    - html ``spikes/highlight`` at ``step``: the highlighted text (``render_highlight_html``);
    - image ``spikes/heatmap`` at ``step``: tokens x layers of the first affected sample
      (PNG rendered under ``run_dir/rendered/``; skipped without matplotlib or ``images=False``);
    - tag ``spike_count``; metrics ``spike/culprits``, ``spike/culprit_share`` (summed share of
      the batch's squared gradient norm), ``spike/culprit_max_norm``.
    The table's columns are fixed at the first event (context columns absent later are None),
    so the growing table keeps one valid schema.
    """

    def __init__(self, tracker: Tracker, run_dir: str | Path | None = None, top_layers: int = 3,
                 images: bool = True, window: int = 48) -> None:
        self.tracker = tracker
        self._run_dir = Path(run_dir) if run_dir is not None else None
        self.top_layers, self.images, self.window = top_layers, images, window
        self.events = 0
        self._extra: list[str] | None = None
        self._sample: list[str] | None = None

    @property
    def run_dir(self) -> Path:
        """Where rendered files go: the given dir, else the tracker's, else a temp dir (made once)."""
        if self._run_dir is None:
            own = getattr(self.tracker, "run_dir", None)
            self._run_dir = Path(own) if own is not None else Path(tempfile.mkdtemp(prefix="gradloc-spikes-"))
        return self._run_dir

    def write(self, step: int, events: Sequence[SpikeEvent], result: LocateResult, ctx: Any) -> None:
        try:
            self._write(int(step), events, result, ctx)
        except Exception as exc:  # forensics must never kill the training run
            warnings.warn(f"gradloc-track: could not write spike artifacts for step {step}: {exc!r}")

    def _write(self, step: int, events: Sequence[SpikeEvent], result: LocateResult, ctx: Any) -> None:
        if self._extra is None:
            self._extra = list(getattr(ctx, "extra_columns", None) or {})
            self._sample = list(getattr(ctx, "sample_columns", None) or {})
        self.events += 1
        self.tracker.set_tags({"spike_count": str(self.events)})
        self.tracker.log_metrics({
            "spike/culprits": float(len(result.tokens)),
            "spike/culprit_share": float(sum(c.share or 0.0 for c in result.tokens)),
            "spike/culprit_max_norm": float(max((c.grad_norm for c in result.tokens), default=0.0)),
        }, step)
        columns, rows = attribution_table(step, events, result, ctx, self.top_layers, self._extra, self._sample)
        if rows:
            self.tracker.log_table(TABLE_KEY, columns, rows, step)
        if getattr(ctx, "input_ids", None) is None:
            return  # no token ids: nothing to show as text
        if getattr(ctx, "micro_batches", None):  # a step of K micro-batches: show the top culprit's
            k = result.tokens[0].micro_batch if result.tokens else 0
            ctx, result = ctx.micro_batch_view(k), result.for_micro_batch(k)
        self.tracker.log_html(HTML_KEY, render_highlight_html(step, events, result, ctx, window=self.window), step)
        samples = sorted({c.batch for c in result.tokens})
        if samples and self.images:
            png = render_layer_heatmap(result, samples[0], self.run_dir / "rendered" / f"heatmap_step_{step:06d}.png",
                                       ctx=ctx)
            if png is not None:
                self.tracker.log_image(IMAGE_KEY, png, step)
