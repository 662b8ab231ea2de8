"""Send a spike to the tracker: its event row; when localized, table rows, highlighted HTML, heatmap.

The training thread does only the cheap part (tags, metrics, the table rows, and CPU copies of
the tensors the renderers read); rendering the HTML and the heatmap, and writing them, is a job
handed to ``tracker.submit``: trackers that own a thread (the background writer of W&B/MLflow,
the local run directory) run it there, in order with the calls made before it, so a spike's media
still land at its step. There the heatmap (matplotlib: most of a second holding the GIL) is drawn by
a low-priority worker process (``render_worker``), so the training steps after a spike do not wait
for it.
"""
from __future__ import annotations

import atexit
import copy
import os
import shutil
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from ..localizer.result import LocateResult
from ..spikes.event import SpikeEvent
from ..trackers.interface import Tracker
from .events import EVENT_COLUMNS, event_row
from .highlight import render_highlight_html
from ..trackers.naming import EVENTS_KEY, HTML_KEY, IMAGE_KEY, TABLE_KEY
from .render_worker import draw_heatmap
from .table import attribution_table, where_columns


_scratch: dict[Path, int] = {}  # the writers' scratch dirs not removed yet -> the process that made each


@atexit.register
def _remove_scratch() -> None:
    """A writer never closed (a ``GradMonitor`` built by hand) leaves no scratch dir behind the process; a
    forked child that exits leaves its parent's alone."""
    me = os.getpid()
    for path, pid in list(_scratch.items()):
        if pid == me:
            shutil.rmtree(path, ignore_errors=True)
            del _scratch[path]


class SpikeArtifactWriter:
    """``write(step, events, result, ctx)`` for each localized spike, ``write_detection(step, events,
    why)`` for one detected but not localized; neither raises into training.

    Every detected spike: a row of table ``spikes/events`` (``artifacts.events``: step, signal, z,
    the other layers that fired, whether it was localized or why not) and tag ``spike_count``
    (detected spikes, localized or not). Per localized event it also logs, with the tracker's file
    layout (see ``trackers/interface.py``):
    - table ``spikes/tokens``: one row per culprit at its level (token, span, sample,
      micro-batch), appended as one part per event (never rewritten; ``read_table`` joins them);
    - html ``spikes/highlight`` at ``step``: the highlighted text of every culprit sample, across
      micro-batches (``render_highlight_html``);
    - image ``spikes/heatmap`` at ``step``: tokens x layers of the first culprit's sample
      (PNG rendered under ``run_dir/rendered/``; skipped without matplotlib or ``images=False``);
    - metrics ``spike/culprits`` (rows of every level), ``spike/culprit_share`` (their summed
      share of the batch's squared gradient norm), ``spike/culprit_max_norm``.
    The table's columns are fixed at the first event (context columns absent later are None),
    so the growing table keeps one valid schema.
    """

    def __init__(self, tracker: Tracker, run_dir: str | Path | None = None, top_layers: int = 3,
                 images: bool = True, window: int = 48) -> None:
        self.tracker = tracker
        self._run_dir = Path(run_dir) if run_dir is not None else None
        self.top_layers, self.images, self.window = top_layers, images, window
        self.events = 0
        self._scratch: Path | None = None  # the temp dir made here, when neither we nor the tracker had one
        self._extra: list[str] | None = None
        self._sample: list[str] | None = None
        self._where: list[str] | None = None

    @property
    def run_dir(self) -> Path:
        """Where rendered files go: the given dir, else the tracker's, else a scratch dir (made once, removed by
        ``close()`` or at exit: its PNGs were only staged for the tracker)."""
        if self._run_dir is None:
            own = getattr(self.tracker, "run_dir", None)
            if own is None:
                self._scratch = Path(tempfile.mkdtemp(prefix="gradloc-spikes-"))
                _scratch[self._scratch] = os.getpid()
            self._run_dir = Path(own) if own is not None else self._scratch
        return self._run_dir

    def close(self) -> None:
        """Remove the scratch dir, if one was made; call it once the tracker has every image (after its
        ``finish()`` or ``flush()``: a background writer uploads from the file). A given or the tracker's run
        dir stays. Idempotent; a later spike makes a new scratch dir."""
        if self._scratch is None:
            return
        if _scratch.get(self._scratch, os.getpid()) != os.getpid():  # a forked child's close: its parent's dir
            self._scratch = self._run_dir = None
            return
        shutil.rmtree(self._scratch, ignore_errors=True)
        _scratch.pop(self._scratch, None)
        self._scratch = self._run_dir = None

    def write(self, step: int, events: Sequence[SpikeEvent], result: LocateResult, ctx: Any) -> None:
        try:
            self._write(int(step), events, result, ctx)
        except Exception as exc:  # forensics must never kill the training run
            warnings.warn(f"gradloc-track: could not write spike artifacts for step {step}: {exc!r}")

    def write_detection(self, step: int, events: Sequence[SpikeEvent], why_not_localized: str,
                        result: Any = None) -> None:
        """A detected spike that was not localized (``why_not_localized``: ``"locate.enabled=false"``,
        ...): its ``spikes/events`` row and the ``spike_count`` tag, nothing rendered."""
        try:
            self._record_event(int(step), events, why_not_localized, result)
        except Exception as exc:  # forensics must never kill the training run
            warnings.warn(f"gradloc-track: could not record the spike at step {step}: {exc!r}")

    def _record_event(self, step: int, events: Sequence[SpikeEvent], localization: str, result: Any,
                      metrics: dict[str, float] | None = None) -> None:
        """The spike's count, its ``spikes/events`` row, and ``metrics`` of its step in the same call as the count."""
        self.events += 1
        # the count as a metric at the spike's step (its chart shows when the spikes came; the latest value is the
        # last spike's count whatever order a replay sends them in) and as a tag (the runs table sorts by it)
        self.tracker.log_metrics({"spike_count": float(self.events), **(metrics or {})}, step)
        self.tracker.set_tags({"spike_count": str(self.events)})
        if events:
            self.tracker.log_table(EVENTS_KEY, EVENT_COLUMNS, [event_row(step, events, localization, result)], step)

    def _write(self, step: int, events: Sequence[SpikeEvent], result: LocateResult, ctx: Any) -> None:
        if self._extra is None:
            self._extra = list(getattr(ctx, "extra_columns", None) or {})
            self._sample = list(getattr(ctx, "sample_columns", None) or {})
            self._where = where_columns(result, ctx)
        tracker = self.tracker
        found = bool(result.culprits)  # a culprit at any level: token, span, sample, micro-batch
        self._record_event(step, events, "localized" if found else "no culprit found", result, {
            "spike/culprits": float(len(result.culprits)),
            "spike/culprit_share": float(sum(c.share or 0.0 for c in result.culprits)),
            "spike/culprit_max_norm": float(max((c.grad_norm for c in result.culprits), default=0.0)),
        })
        columns, rows = attribution_table(step, events, result, ctx, self.top_layers, self._extra, self._sample,
                                          self._where)
        if rows:
            tracker.log_table(TABLE_KEY, columns, rows, step)
        if getattr(ctx, "input_ids", None) is None:
            return  # no token ids: nothing to show as text
        png = self.run_dir / "rendered" / f"heatmap_step_{step:06d}.png" if self.images else None
        job = _RenderJob(step, list(events), result, cpu_snapshot(ctx), self.window, png)
        submit = getattr(tracker, "submit", None)
        submit(job) if callable(submit) else job(tracker)  # a duck-typed tracker: render here


def _cpu(x: Any) -> Any:
    """A CPU copy of every tensor in ``x`` (nested lists/tuples/dicts): the loop may reuse its buffers."""
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu", copy=True)  # host sync: once per spike event
    if isinstance(x, (list, tuple)):
        return type(x)(_cpu(v) for v in x)
    if isinstance(x, Mapping):
        return {k: _cpu(v) for k, v in x.items()}
    return x


def cpu_snapshot(ctx: Any) -> Any:
    """A shallow copy of the spike context whose tensors are CPU copies (what the renderers read)."""
    snap = copy.copy(ctx)
    for name in ("input_ids", "token_mask", "extra_columns", "sample_columns", "segment_ids", "document_ids"):
        if hasattr(snap, name):
            try:
                setattr(snap, name, _cpu(getattr(ctx, name)))
            except (AttributeError, TypeError):  # a frozen/slotted context: keep the original
                pass
    return snap


class _RenderJob:
    """Renders one event's HTML and heatmap (once, even when several trackers run the job)."""

    def __init__(self, step, events, result, ctx, window, png_path) -> None:
        self.step, self.events, self.result, self.ctx, self.window, self.png_path = \
            step, events, result, ctx, window, png_path
        self._lock = threading.Lock()
        self._hurry = threading.Event()
        self._done = False
        self._html: str | None = None
        self._png: Path | None = None

    def _render(self) -> None:
        with self._lock:
            if self._done:
                return
            self._done = True
            self._html = render_highlight_html(self.step, self.events, self.result, self.ctx, window=self.window)
            try:  # the page goes out even when its image cannot be made (no room anywhere for the PNG)
                self._png = self._heatmap()
            except Exception as exc:
                warnings.warn(f"gradloc-track: the heatmap of the spike at step {self.step} could not be made: "
                              f"{exc!r}; its page is logged without it", RuntimeWarning)

    def _heatmap(self) -> Path | None:
        first = next((c for c in self.result.culprits if c.batch is not None), None)
        if first is None or self.png_path is None:
            return None
        result, ctx = self.result, self.ctx
        if getattr(ctx, "micro_batches", None):  # K micro-batches: the first culprit's
            k = first.micro_batch or 0
            ctx, result = ctx.micro_batch_view(k), result.for_micro_batch(k)
        if result.layer_map is None or result.layer_map.shape[0] == 0:  # a non-finite step's culprits are named
            return None  # from their losses, a model without readable layers has no map: no image
        return draw_heatmap(result, first.batch, self.png_path, ctx, self._hurry)

    def hurry(self) -> None:
        """The caller waits for this job (the tracker's ``flush()`` or ``finish()``): draw here, now, not in
        the low-priority worker."""
        self._hurry.set()

    def __call__(self, tracker: Tracker) -> None:
        self._render()
        if self._html is not None:
            tracker.log_html(HTML_KEY, self._html, self.step)
        if self._png is not None:
            tracker.log_image(IMAGE_KEY, self._png, self.step)
