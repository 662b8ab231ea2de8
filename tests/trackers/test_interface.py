"""The tracker interface (``trackers/interface.py``): do-nothing defaults, and every implementation takes
the same ``flush``/``finish`` arguments, so no caller has to probe a signature."""
from __future__ import annotations

import inspect

import pytest

from gradloc_track.trackers import FanoutTracker, LocalTracker, MemoryTracker, NullTracker, Tracker
from gradloc_track.trackers.async_writer import AsyncTracker
from gradloc_track.trackers.backends.tensorboard import TensorBoardTracker
from gradloc_track.trackers.mlflow_tracker import MlflowTracker
from gradloc_track.trackers.wandb_tracker import WandbTracker

IMPLEMENTATIONS = [Tracker, NullTracker, MemoryTracker, LocalTracker, FanoutTracker, AsyncTracker, MlflowTracker,
                   WandbTracker, TensorBoardTracker]


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


def test_a_forwarding_tracker_hands_every_call_to_its_inner_tracker(tmp_path):
    from gradloc_track.trackers.interface import ForwardingTracker
    from gradloc_track.trackers.memory_tracker import MemoryTracker

    inner = MemoryTracker(run_dir=tmp_path)
    fwd = ForwardingTracker(inner)
    fwd.log_metrics({"a": 1.0}, 3)
    fwd.log_params({"lr": 0.1})
    fwd.log_table("spikes/tokens", ["x"], [[1]], 3)
    fwd.log_html("spikes/highlight", "<p>x</p>", 3)
    fwd.set_tags({"spike_count": "1"})
    seen = []
    fwd.submit(seen.append)
    fwd.finish("success")
    assert inner.metrics == [(3, {"a": 1.0})] and inner.params == {"lr": 0.1}
    assert inner.html == [("spikes/highlight", 3, "<p>x</p>")] and seen == [inner]
    assert inner.tags == {"spike_count": "1"} and inner.table_calls == [("spikes/tokens", 3, [[1]])]
    assert fwd.run_dir == tmp_path and fwd.dropped == 0 and inner.finished == "success"


def test_a_record_goes_to_the_method_of_its_name_and_an_unknown_one_is_refused():
    """Issue 42: the writer and replay send a queued/spooled record through ``send``, one named method per
    call (no ``getattr(tracker, call)``): every call a record can carry arrives, with the timestamp only
    where the backend takes one; a call no method has is an error naming it."""
    from gradloc_track.trackers.interface import send

    class Stamped(MemoryTracker):
        accepts_timestamp = True

        def log_metrics(self, metrics, step, timestamp_ms=None):
            self.stamps = getattr(self, "stamps", []) + [timestamp_ms]
            super().log_metrics(metrics, step)

    mem = MemoryTracker()
    for call, args in [("log_metrics", ({"a": 1.0}, 3)), ("log_metric_records", ([({"b": 2.0}, 4, 9)],)),
                       ("log_params", ({"p": 1},)), ("log_table", ("t", ["c"], [[1]], 3)),
                       ("log_html", ("h", "<p>x</p>", 3)), ("set_tags", ({"k": "v"},)), ("finish", ("failed",))]:
        send(mem, call, args, ts=7)
    assert mem.metrics == [(3, {"a": 1.0}), (4, {"b": 2.0})] and mem.params == {"p": 1}
    assert mem.tables["t"]["rows"] == [[1]] and mem.tags == {"k": "v"} and mem.finished == "failed"
    stamped = Stamped()
    send(stamped, "log_metrics", ({"a": 1.0}, 0), ts=5)
    assert stamped.stamps == [5]
    with pytest.raises(ValueError, match="log_everything"):
        send(mem, "log_everything", ())
