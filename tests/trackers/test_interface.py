"""The tracker interface (``trackers/interface.py``): do-nothing defaults, and every implementation takes
the same ``flush``/``finish`` arguments, so no caller has to probe a signature."""
from __future__ import annotations

import inspect

import pytest

from gradloc_track.trackers import FanoutTracker, LocalTracker, MemoryTracker, NullTracker, Tracker
from gradloc_track.trackers.async_writer import AsyncTracker
from gradloc_track.trackers.mlflow_tracker import MlflowTracker
from gradloc_track.trackers.wandb_tracker import WandbTracker

IMPLEMENTATIONS = [Tracker, NullTracker, MemoryTracker, LocalTracker, FanoutTracker, AsyncTracker, MlflowTracker,
                   WandbTracker]


def _params(fn) -> list[tuple[str, object]]:
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("cls", IMPLEMENTATIONS, ids=lambda c: c.__name__)
def test_every_tracker_takes_the_interface_flush_and_finish_arguments(cls):
    assert _params(cls.flush)[1:] == [("timeout_s", None)]
    assert _params(cls.finish)[1:] == [("status", "success"), ("timeout_s", None)]


def test_a_tracker_without_submit_still_gets_artifacts(tmp_path):
    class Plain(Tracker):  # duck-typed: submit runs the job here (base behaviour)
        def __init__(self):
            self.html = []

        def log_html(self, key, html, step=None):
            self.html.append(step)

    assert NullTracker().submit(lambda t: 1 / 0) is None  # logging off: nothing rendered
    plain = Plain()
    plain.submit(lambda t: t.log_html("k", "<p/>", 3))
    assert plain.html == [3]
