"""The user's own W&B run (``watch()`` joined ``wandb.run``): our records in THEIR rows.

W&B has one step per run, and rows only append: once W&B's step is past ``s`` a
``wandb.log(..., step=s)`` is dropped ("step less than the current step"). A library that logs
rows of its own into the user's run (``commit=True``) pushes the step ahead of the user's, so the
user loses points. Here W&B's step is left to the user:

- ours go into the row the user is filling (``commit=False``, never ``step=``), plotted against
  our own x-axis ``gradloc/step`` (``define_metric``), a key the user never logs;
- W&B keeps one value per key per row, so one record of ours per row: a record arriving while
  ours already sits in the user's current row (``run.step`` says which row that is) waits for the
  user's next row. Records of one step are merged into one.
- they are logged on the training thread, where the monitor runs (the optimizer hook), as the
  user's own ``wandb.log`` calls are: then each iteration's record meets each iteration's row in
  the same order every time (a background thread's timing would pair them at random and lose
  records). ``wandb.log`` only hands the row to W&B's service; ``SharedRunTracker`` sends
  anything that fails through the background writer (spool) instead.

A user logging fewer rows than we log steps shares rows: past ``MAX_HELD`` waiting records (and at
``finish``) the oldest goes into the current row anyway, replacing ours there; counted in
``merged`` and said once, with the fix. A user whose run has no row of its own since we joined
(they log nothing per step) is not pushed ahead of: our records then become rows of their own at
the training step (``step=``, as in a run we open), said once.
"""
from __future__ import annotations

import collections
import threading
import warnings
from pathlib import Path
from typing import Any, Callable

from .interface import Tracker

MAX_HELD = 8  # our records waiting for the user's next rows before one shares a row


class SharedRows:
    """Places our records in the W&B run's rows (thread-safe: the training thread and the writer's)."""

    def __init__(self, run: Any, step_key: str) -> None:
        self.run, self.step_key = run, step_key
        self._lock = threading.Lock()
        self._held: collections.deque = collections.deque()  # [step, data], oldest first
        self._row: int | None = None  # the user's row our last record went into...
        self._row_step: int | None = None  # ...and its step
        self._first_row: int | None = None  # the row when we first logged (has the user moved since?)
        self._lead = False  # the user logs no rows: ours are rows of their own
        self.merged = 0  # records of ours replaced by a later one in a shared row

    def log(self, data: dict[str, Any], step: int | None) -> None:
        with self._lock:
            if step is not None and self._held and self._held[-1][0] == step:
                self._held[-1][1].update(data)  # one record per step
            else:
                self._held.append([step, {self.step_key: step, **data} if step is not None else dict(data)])
            self._drain(at_end=False)

    def finish(self) -> None:
        """Everything still waiting goes in (the user's training is over); say what was merged."""
        with self._lock:
            self._drain(at_end=True)
        if self.merged:
            warnings.warn(f"gradloc-track: {self.merged} of our W&B records shared a row of your run with a later "
                          "one (W&B keeps one value per key per row, and we never move your run's step): log your "
                          "own metrics every step, raise monitor.log_every, or give gradloc-track a run of its own "
                          "(tracker='wandb')", RuntimeWarning, stacklevel=3)

    def _drain(self, at_end: bool) -> None:
        while self._held:
            row = self._current_row()
            if self._first_row is None:
                self._first_row = row
            if self._lead:
                self._log_own_row(row)
            elif row is None or row != self._row or self._held[0][0] == self._row_step:
                self._log_in_row(row)  # a new row of the user's (or the same step: its keys merge)
            elif not at_end and len(self._held) <= MAX_HELD:
                return  # ours already sits in this row: the next record waits for the user's next row
            elif row == self._first_row:
                self._start_leading()
            else:
                self.merged += 1  # the record in this row is replaced by this one
                self._log_in_row(row)

    def _log_in_row(self, row: int | None) -> None:
        step, data = self._held.popleft()
        self.run.log(data, commit=False)
        self._row, self._row_step = row, step

    def _log_own_row(self, row: int | None) -> None:
        step, data = self._held.popleft()
        if step is None or row is None:
            self.run.log(data, commit=False)
        else:
            self.run.log(data, step=max(step, row))  # W&B's step = the training step, as in a run we open

    def _start_leading(self) -> None:
        self._lead = True
        warnings.warn("gradloc-track: your W&B run has had no row of its own since watch() joined it, so our metrics "
                      "now go in rows of their own at the training step (W&B's step = the training step). Log with "
                      "step= the training step or without step=, or give gradloc-track a run of its own "
                      "(tracker='wandb')", RuntimeWarning, stacklevel=4)

    def _current_row(self) -> int | None:
        """The W&B row a ``log`` call would go into now (``None`` where W&B cannot say)."""
        try:
            return int(self.run.step)
        except Exception:  # noqa: BLE001 - mode="shared" runs
            return None


class SharedRunTracker(Tracker):
    """The user's own W&B run: metrics logged on the calling (training) thread through ``adapter``;
    everything else, and any metrics that fail there, through ``writer`` (the background writer
    with its spool, whose backend is the same adapter)."""

    runs_jobs_off_thread = True

    def __init__(self, adapter: Tracker, writer: Tracker) -> None:
        self.adapter, self.writer = adapter, writer
        self.name = "wandb"

    @property
    def run_dir(self) -> Path | None:
        return self.writer.run_dir

    @property
    def dropped(self) -> int:
        return self.writer.dropped

    def log_metrics(self, metrics, step):
        try:
            self.adapter.log_metrics(metrics, step)
        except Exception:  # noqa: BLE001 - never into training: the writer retries, else spools
            self.writer.log_metrics(metrics, step)

    def log_params(self, params):
        self.writer.log_params(params)

    def log_table(self, key, columns, rows, step=None):
        self.writer.log_table(key, columns, rows, step)

    def log_html(self, key, html, step=None):
        self.writer.log_html(key, html, step)

    def log_image(self, key, path, step=None):
        self.writer.log_image(key, path, step)

    def log_artifact(self, path, artifact_path=None):
        self.writer.log_artifact(path, artifact_path)

    def set_tags(self, tags):
        self.writer.set_tags(tags)

    def submit(self, job: Callable[[Tracker], None]) -> None:
        self.writer.submit(job)

    def flush(self, timeout_s: float | None = None) -> None:
        self.writer.flush(timeout_s)

    def finish(self, status: str = "success", timeout_s: float | None = None) -> None:
        self.writer.finish(status, timeout_s)
