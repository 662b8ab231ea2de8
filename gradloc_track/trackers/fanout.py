"""Fan one stream of calls out to several trackers (``tracker=both``)."""
from __future__ import annotations

import time
from typing import Sequence

from .interface import Tracker


class FanoutTracker(Tracker):
    """Calls every child in order. Children handle their own failures (see AsyncTracker)."""

    name = "fanout"

    def __init__(self, trackers: Sequence[Tracker]) -> None:
        self.trackers = list(trackers)
        self.run_dir = next((t.run_dir for t in self.trackers if t.run_dir is not None), None)

    def _each(self, method: str, *args, **kwargs) -> None:
        for t in self.trackers:
            getattr(t, method)(*args, **kwargs)

    def log_metrics(self, metrics, step):
        self._each("log_metrics", metrics, step)

    def log_params(self, params):
        self._each("log_params", params)

    def log_table(self, key, columns, rows, step=None):
        self._each("log_table", key, columns, rows, step)

    def log_html(self, key, html, step=None):
        self._each("log_html", key, html, step)

    def log_image(self, key, path, step=None):
        self._each("log_image", key, path, step)

    def log_artifact(self, path, artifact_path=None):
        self._each("log_artifact", path, artifact_path)

    def set_tags(self, tags):
        self._each("set_tags", tags)

    @property
    def runs_jobs_off_thread(self) -> bool:
        return all(t.runs_jobs_off_thread for t in self.trackers)

    @property
    def dropped(self) -> int:
        return sum(t.dropped for t in self.trackers)

    @property
    def finish_timeout_s(self) -> float:
        return sum(getattr(t, "finish_timeout_s", 0.0) for t in self.trackers)

    def submit(self, job):
        # each child runs the job against itself; jobs memoize their rendering, so it happens once
        self._each("submit", job)

    def flush(self, timeout_s=None):
        for t, left in self._shared(timeout_s):
            t.flush(timeout_s=left)

    def finish(self, status="success", timeout_s=None):
        from . import sigterm

        sigterm.forget(self)
        for t, left in self._shared(timeout_s):
            t.finish(status, timeout_s=left)

    def _shared(self, timeout_s: float | None):
        """Each child with the time left of ONE bound for all (``None``: each child's own bound)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for t in self.trackers:
            yield t, None if deadline is None else max(0.0, deadline - time.monotonic())


def as_one_tracker(trackers: Sequence[Tracker]) -> Tracker | None:
    """The tracker itself when there is one, a ``FanoutTracker`` over several, ``None`` for none."""
    if not trackers:
        return None
    return trackers[0] if len(trackers) == 1 else FanoutTracker(trackers)
