"""Outage mechanics without a server: exact spool round-trip, bounded finish() with a hung
backend, probing back to health, SIGTERM chaining, atomic local files, artifacts off-thread."""
from __future__ import annotations

import json
import math
import os
import signal
import threading
import time
import warnings

import pytest

from gradloc_track.config import TrackerConfig
from gradloc_track.trackers import LocalTracker, MemoryTracker, Tracker, files, make_tracker, read_spool, sigterm
from gradloc_track.trackers.async_writer import AsyncTracker
from gradloc_track.trackers.spool import Spool

VALUES = {"token": "inf", "tok2": "nan", "tok3": "-inf", "x": math.inf, "y": -math.inf, "n": 3, "big": 2 ** 60,
          "b": True, "none": None, "f": 0.1, "nested": [[1, "inf", 2.5], {"k": "NaN"}], "tag": {"__x": 1}}


def test_spool_round_trips_every_value_type_exactly(tmp_path):
    spool = Spool(tmp_path / "s.jsonl", "b")
    spool.write("log_table", ["k", list(VALUES), [list(VALUES.values()) + [math.nan]]], "err")
    (rec,) = read_spool(tmp_path / "s.jsonl")
    key, cols, (row,) = rec["args"]
    assert cols == list(VALUES) and row[:-1] == list(VALUES.values())
    assert [type(v) for v in row[:-1]] == [type(v) for v in VALUES.values()]  # ints stay ints, "inf" a str
    assert isinstance(row[-1], float) and math.isnan(row[-1])


class Hangs(MemoryTracker):
    """Fault injection: log_metrics of step >= 3 never returns (until the test ends)."""

    def __init__(self):
        super().__init__()
        self.release = threading.Event()

    def log_metrics(self, metrics, step):
        if step >= 3:
            self.release.wait(60)
        super().log_metrics(metrics, step)


def test_finish_is_bounded_with_a_hung_backend_and_spools_the_rest(tmp_path):
    backend = Hangs()
    tracker = AsyncTracker(lambda: backend, "hung", tmp_path, call_timeout_s=30.0, finish_timeout_s=1.0,
                           flush_interval_s=0.01)
    for step in range(3):
        tracker.log_metrics({"x": float(step)}, step)
    tracker.flush()
    for step in range(3, 10):
        tracker.log_metrics({"x": float(step)}, step)
    tracker.set_tags({"spike_count": "1"})
    t0 = time.perf_counter()
    with pytest.warns(RuntimeWarning, match="did not finish within the bound"):
        tracker.finish("success")
    took = time.perf_counter() - t0
    backend.release.set()
    assert took < 1.0 + 5.0, f"finish() took {took:.1f} s with a 1 s bound (the hung call waits 60 s)"
    recs = read_spool(tmp_path / "spool" / "hung.jsonl")
    assert sorted(r["args"][1] for r in recs if r["call"] == "log_metrics") == list(range(3, 10))
    assert any("in flight" in r["error"] for r in recs)  # step 3: maybe in the backend too (replay dedups)
    assert [r["call"] for r in recs][-1] == "finish" and recs[-1]["args"] == ["success"]
    assert [s for s, _ in backend.metrics][:3] == [0, 1, 2]


def test_fanout_finish_shares_one_bound_between_hung_backends(tmp_path):
    """tracker=both under SIGTERM: the two backends share the grace period, so the second one
    still spools its records and status before the handler gives up."""
    from gradloc_track.trackers.fanout import FanoutTracker

    backends = [Hangs(), Hangs()]
    children = [AsyncTracker(lambda b=b: b, f"hung{i}", tmp_path, call_timeout_s=30.0, flush_interval_s=0.01)
                for i, b in enumerate(backends)]
    both = FanoutTracker(children)
    for step in range(6):
        both.log_metrics({"x": float(step)}, step)
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        both.finish("killed", timeout_s=2.0)
    took = time.perf_counter() - t0
    for b in backends:
        b.release.set()
    assert took < 2.0 + 3.0, f"finish() took {took:.1f} s for a 2 s bound shared by both backends"
    for i in range(2):
        recs = read_spool(tmp_path / "spool" / f"hung{i}.jsonl")
        assert [r["call"] for r in recs][-1] == "finish" and recs[-1]["args"] == ["killed"]


class DownThenUp(MemoryTracker):
    def __init__(self):
        super().__init__()
        self.down = True

    def log_metrics(self, metrics, step):
        if self.down:
            raise ConnectionError("down")
        super().log_metrics(metrics, step)


def test_down_backend_is_skipped_then_probed_back(tmp_path):
    backend = DownThenUp()
    tracker = AsyncTracker(lambda: backend, "probe", tmp_path, retries=0, probe_interval_s=2.0, flush_interval_s=0.01)
    with pytest.warns(RuntimeWarning, match="probe"):
        tracker.log_metrics({"x": 0.0}, 0)
        tracker.flush()
        assert not tracker.healthy
        backend.down = False
        tracker.log_metrics({"x": 1.0}, 1)  # within the probe interval: straight to the spool
        tracker.flush()
        time.sleep(2.1)
        tracker.log_metrics({"x": 2.0}, 2)  # the probe
        tracker.flush()
    assert tracker.healthy
    tracker.finish()
    assert [s for s, _ in backend.metrics] == [2] and backend.finished == "success"
    assert [r["args"][1] for r in read_spool(tmp_path / "spool" / "probe.jsonl")] == [0, 1]


def test_sigterm_finishes_killed_and_chains_to_the_previous_handler(tmp_path):
    called = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: called.append(signum))
    try:
        tracker = make_tracker(TrackerConfig(kind="none"), run_dir=tmp_path)
        assert signal.getsignal(signal.SIGTERM) is sigterm._handler
        tracker.log_metrics({"x": 1.0}, 0)
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 10
        while not called and time.monotonic() < deadline:
            time.sleep(0.01)
        assert called == [signal.SIGTERM]  # the handler installed before ours still ran
        assert json.loads((tmp_path / "tags.json").read_text())["status"] == "killed"
        assert signal.getsignal(signal.SIGTERM) is not sigterm._handler  # ours is gone with the run
        tracker.log_metrics({"x": 2.0}, 1)  # after the run ended: never raises
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_handler_is_installed_only_while_a_run_is_open(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    tracker = make_tracker(TrackerConfig(kind="none"), run_dir=tmp_path)
    assert signal.getsignal(signal.SIGTERM) is sigterm._handler
    tracker.finish()
    assert signal.getsignal(signal.SIGTERM) is before
    done = []
    t = threading.Thread(target=lambda: done.append(make_tracker(TrackerConfig(kind="none"), run_dir=tmp_path / "t")))
    t.start()
    t.join()
    assert signal.getsignal(signal.SIGTERM) is before  # not from another thread
    done[0].finish()


def test_local_files_are_replaced_atomically(tmp_path, monkeypatch):
    tracker = LocalTracker(tmp_path)
    tracker.set_tags({"a": "1"})

    def crash(src, dst):
        raise OSError(5, "I/O error (injected: killed before the rename)")
    monkeypatch.setattr(os, "replace", crash)
    with pytest.warns(RuntimeWarning, match="cannot write"):
        tracker.set_tags({"b": "2"})  # never raises into training
    assert json.loads((tmp_path / "tags.json").read_text()) == {"a": "1"}  # the old file, whole
    assert [p.name for p in tmp_path.iterdir()] == ["tags.json"]  # no temp file left behind
    assert tracker.dropped == 1


def test_artifacts_render_off_the_training_thread_in_order(tmp_path, monkeypatch):
    import torch

    from gradloc_track.artifacts import SpikeArtifactWriter, writer
    from gradloc_track.locate.result import CulpritToken, LocateResult
    from gradloc_track.spikes import SpikeContext, SpikeEvent

    threads = []
    real = writer.render_highlight_html

    def spy(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return real(*args, **kwargs)
    monkeypatch.setattr(writer, "render_highlight_html", spy)
    ids = torch.full((2, 8), ord("a"))
    ids[1, 3] = ord("Z")
    ctx = SpikeContext(loss_fn=lambda m: m.sum(), token_mask=torch.ones(2, 8), input_ids=ids, tokenizer=None)
    result = LocateResult(tokens=[CulpritToken(1, 3, 5.0, {"h.0": 5.0}, share=0.9)], probes=3, method="auto",
                          threshold=1.0, total_norm=5.0, layer_names=["h.0"])
    backend = MemoryTracker()
    tracker = AsyncTracker(lambda: backend, "mem", tmp_path)
    SpikeArtifactWriter(tracker, tmp_path, images=False).write(7, [SpikeEvent(7, "global", 5, 1, 9, 5)], result, ctx)
    ids.fill_(0)  # the training loop reuses its buffer: the artifact shows the batch as it was
    tracker.finish()
    assert threads and "MainThread" not in threads
    assert [(k, s) for k, s, _ in backend.html] == [("spikes/highlight", 7)]
    assert backend.table_calls[0][:2] == ("spikes/tokens", 7)
    assert backend.tags["spike_count"] == "1"


def test_a_tracker_without_submit_still_gets_artifacts(tmp_path):
    class Plain(Tracker):  # duck-typed: submit runs the job here (base behaviour)
        def __init__(self):
            self.html = []

        def log_html(self, key, html, step=None):
            self.html.append(step)

    from gradloc_track.trackers import NullTracker

    assert NullTracker().submit(lambda t: 1 / 0) is None  # logging off: nothing rendered
    plain = Plain()
    plain.submit(lambda t: t.log_html("k", "<p/>", 3))
    assert plain.html == [3]


def test_spool_write_failure_is_reported_once(tmp_path, monkeypatch):
    def full(path, line):
        raise OSError(28, "No space left on device (injected)")
    monkeypatch.setattr(files, "append_line", full)
    spool = Spool(tmp_path / "s.jsonl", "b")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(5):
            assert spool.write("log_metrics", [{"x": 1.0}, i], "down") is False
    assert spool.dropped == 5 and len([w for w in caught if "LOST" in str(w.message)]) == 1


def test_replay_cli_names_the_fix_when_there_is_nothing_to_replay(tmp_path, capsys):
    from gradloc_track.cli import main

    assert main(["replay", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no spool/*.jsonl" in err and "pass the run directory" in err


def test_replay_into_a_given_tracker_sends_every_record_once(tmp_path):
    from gradloc_track.trackers import replay_spool

    spool = Spool(tmp_path / "spool" / "x.jsonl", "x")
    spool.write("log_metrics", [{"a": 1.0, "tok": "nan"}, 0], "down", ts=5)
    spool.write("log_table", ["t", ["c"], [[2]], 0], "down", ts=6)
    spool.write("finish", ["failed"], "down", ts=7)
    target = MemoryTracker()
    assert replay_spool(tmp_path, target) == 2
    assert target.metrics == [(0, {"a": 1.0, "tok": "nan"})] and target.tables["t"]["rows"] == [[2]]
    assert target.finished is None  # a given tracker is not finished by the replay
