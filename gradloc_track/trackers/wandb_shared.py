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

Media (tables, HTML, images: a spike's artifacts) arrive late, rendered on the writer's thread
many rows after their step. They ride in a lane of their own, on their own x-axis
``gradloc/media_step`` (each media key ``define_metric``-ed against it): a row holds at most one
metrics record (at ``gradloc/step``) AND one media step (at ``gradloc/media_step``), so a spike's
table lands at the spike's own step whatever row it finds and whatever the user logs in between,
and never takes a row from our metrics (a media record at ``gradloc/step`` would need a row of its
own: every later metric one row behind, for good, until rows had to be shared). Media of another
step wait for the next row; any still waiting at ``finish`` get rows after the user's last.

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
from typing import Any

from .interface import ForwardingTracker, Tracker

MAX_HELD = 8  # our records waiting for the user's next rows before one shares a row
MEDIA_STEP_KEY = "gradloc/media_step"  # the x-axis of our media in the user's run


class SharedRows:
    """Places our records in the W&B run's rows (thread-safe: the training thread and the writer's)."""

    def __init__(self, run: Any, step_key: str, media_step_key: str = MEDIA_STEP_KEY) -> None:
        self.run, self.step_key, self.media_step_key = run, step_key, media_step_key
        self._lock = threading.Lock()
        self._held: collections.deque = collections.deque()  # metrics: [step, data], oldest first
        self._row: int | None = None  # the user's row our last metrics record went into...
        self._row_step: int | None = None  # ...and its step
        self._media: collections.deque = collections.deque()  # media: [step, data], oldest first
        self._media_row: int | None = None  # the row our last media went into...
        self._media_step: int | None = None  # ...and their step
        self._first_row: int | None = None  # the row when we first logged (has the user moved since?)
        self._lead = False  # the user logs no rows: ours are rows of their own
        self._defined: set[str] = set()  # media keys plotted against media_step_key
        self.merged = 0  # records of ours replaced by a later one in a shared row

    def log(self, data: dict[str, Any], step: int | None, media: bool = False) -> None:
        with self._lock:
            if media:
                self._define(data)
                _add(self._media, self.media_step_key, data, step, replace=False)
            else:
                _add(self._held, self.step_key, data, step, replace=True)
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

    def _define(self, data: dict[str, Any]) -> None:
        """Each media key against our media step, once; and its folder's glob (``spikes/*``: W&B
        flattens a media value into sub-keys that only globs reach; our media folders hold no metric)."""
        if not self._defined:
            self.run.define_metric(self.media_step_key)
        for key in data:
            for name in (key, f"{key.split('/', 1)[0]}/*" if "/" in key else key):
                if name not in self._defined:
                    self._defined.add(name)
                    self.run.define_metric(name, step_metric=self.media_step_key)

    def _drain(self, at_end: bool) -> None:
        self._drain_metrics(at_end)
        self._drain_media(at_end)

    def _drain_metrics(self, at_end: bool) -> None:
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

    def _drain_media(self, at_end: bool) -> None:
        while self._media:
            row = self._current_row()
            if row is None or row != self._media_row:
                self._place_media(self._media[0], row)  # no media of ours in this row yet: the oldest takes it
                continue
            fits = next((r for r in self._media if r[0] is None or r[0] == self._media_step), None)
            if fits is not None:
                self._place_media(fits, row)  # (a later record of the step this row holds: it goes in too)
            elif not at_end:
                return  # media of another step sit in this row: the rest wait for the next row
            else:
                self.run.log({}, commit=True)  # training is over: a row after the user's last
                if self._current_row() == row:  # (a run whose step W&B cannot move: nothing else to do)
                    self._media_row = None

    def _place_media(self, record: list, row: int | None) -> None:
        del self._media[next(i for i, r in enumerate(self._media) if r is record)]
        step, data = record
        self.run.log(data, commit=False)
        if step is not None:
            self._media_row, self._media_step = row, step

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


def _add(lane: collections.deque, step_key: str, data: dict[str, Any], step: int | None, replace: bool) -> None:
    """Append a record to ``lane``, merged into the last one when it is of the same step (media: only
    when no key is in both, so no table replaces another)."""
    last = lane[-1] if lane else None
    if step is not None and last is not None and last[0] == step and (replace or not data.keys() & last[1].keys()):
        last[1].update(data)
    else:
        lane.append([step, {step_key: step, **data} if step is not None else dict(data)])


class SharedRunTracker(ForwardingTracker):
    """The user's own W&B run: metrics and tables logged on the calling (training) thread through
    ``adapter`` (a spike's tables are logged at its step: they land in its row); everything else
    (HTML and images rendered later, params, tags), and anything that fails there, through
    ``writer`` (the background writer with its spool, whose backend is the same adapter)."""

    runs_jobs_off_thread = True

    def __init__(self, adapter: Tracker, writer: Tracker) -> None:
        super().__init__(writer)  # ``inner``: the writer, where every call but these two goes
        self.adapter = adapter
        self.name = "wandb"

    def log_metrics(self, metrics, step):
        try:
            self.adapter.log_metrics(metrics, step)
        except Exception:  # noqa: BLE001 - never into training: the writer retries, else spools
            self.inner.log_metrics(metrics, step)

    def log_table(self, key, columns, rows, step=None):
        try:  # (logged in the hook at the spike's step: it lands in that very row)
            self.adapter.log_table(key, columns, rows, step)
        except Exception:  # noqa: BLE001 - never into training: the writer retries, else spools
            self.inner.log_table(key, columns, rows, step)
