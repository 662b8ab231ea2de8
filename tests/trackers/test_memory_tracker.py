"""``trackers/memory_tracker.MemoryTracker``: every call recorded as made, copies not references,
tables that refuse a change of columns, and the helpers tests read it with."""
from __future__ import annotations

from pathlib import Path

import pytest

from gradloc_track.trackers.interface import Tracker
from gradloc_track.trackers.memory_tracker import MemoryTracker


def test_it_is_a_tracker_with_an_optional_run_dir(tmp_path):
    assert isinstance(MemoryTracker(), Tracker) and MemoryTracker.name == "memory"
    assert MemoryTracker().run_dir is None and MemoryTracker(str(tmp_path)).run_dir == tmp_path


def test_metrics_are_kept_in_call_order_as_copies():
    t = MemoryTracker()
    m = {"loss": 1.0}
    t.log_metrics(m, 2.0)
    m["loss"] = 99.0  # the caller reuses its dict: the record keeps what was logged
    t.log_metrics({"loss": 0.5, "lr": 0.1}, 1)
    t.log_metrics({"lr": 0.2}, 3)
    assert t.metrics == [(2, {"loss": 1.0}), (1, {"loss": 0.5, "lr": 0.1}), (3, {"lr": 0.2})]
    assert isinstance(t.metrics[0][0], int)
    assert t.series("loss") == [(2, 1.0), (1, 0.5)] and t.series("lr") == [(1, 0.1), (3, 0.2)]
    assert t.series("absent") == [] and t.keys() == {"loss", "lr"}


def test_tables_append_rows_and_refuse_other_columns():
    t = MemoryTracker()
    t.log_table("spikes/tokens", ("a", "b"), [(1, 2)], step=5)
    t.log_table("spikes/tokens", ["a", "b"], iter([[3, 4], (5, 6)]))
    assert t.tables == {"spikes/tokens": {"columns": ["a", "b"], "rows": [[1, 2], [3, 4], [5, 6]]}}
    assert t.table_calls == [("spikes/tokens", 5, [[1, 2]]), ("spikes/tokens", None, [[3, 4], [5, 6]])]
    with pytest.raises(ValueError, match=r"table 'spikes/tokens': columns \['a', 'c'\] differ from \['a', 'b'\]"):
        t.log_table("spikes/tokens", ["a", "c"], [[7, 8]])
    assert len(t.tables["spikes/tokens"]["rows"]) == 3  # the refused rows are not kept


def test_params_tags_artifacts_and_the_final_status():
    t = MemoryTracker()
    t.log_params({"lr": 0.1})
    t.log_params({"lr": 0.2, "bs": 4})
    t.set_tags({"seed": 3, "kind": "demo"})
    t.log_html("spikes/highlight", "<p>x</p>", step=7)
    t.log_image("grads", "img.png")
    t.log_artifact("a/b.txt", "files")
    assert t.params == {"lr": 0.2, "bs": 4} and t.tags == {"seed": "3", "kind": "demo"}
    assert t.html == [("spikes/highlight", 7, "<p>x</p>")] and t.images == [("grads", None, Path("img.png"))]
    assert t.artifacts == [(Path("a/b.txt"), "files")]
    assert t.finished is None
    t.finish("failed", timeout_s=1.0)
    assert t.finished == "failed"
