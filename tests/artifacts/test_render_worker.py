"""The spike heatmap drawn off the training process's GIL (issue 38 item 4): a tracker that runs jobs on a
thread of its own hands the drawing to a low-priority worker process; the training thread's own calls, and
what cannot be pickled, are drawn in this process as before."""
from __future__ import annotations

import os
import threading
import time

import pytest

from gradloc_track.artifacts import SpikeArtifactWriter, heatmap, render_worker
from gradloc_track.config import TrackerConfig
from gradloc_track.trackers import MemoryTracker, make_tracker

pytestmark = pytest.mark.skipif(os.name != "posix", reason="the worker's pipes are waited on with select()")


@pytest.fixture
def drawn_here(monkeypatch):
    """The heatmaps this process draws itself (the worker's are not counted)."""
    calls = []
    real = heatmap.render_layer_heatmap

    def counted(*args, **kwargs):
        calls.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(heatmap, "render_layer_heatmap", counted)
    return calls


def test_a_trackers_thread_hands_the_heatmap_to_a_low_priority_process(spike, tmp_path, drawn_here):
    events, result, ctx = spike
    tracker = make_tracker(TrackerConfig(kind="none"), run_dir=tmp_path)  # runs the render job on its thread
    SpikeArtifactWriter(tracker, tmp_path).write(7, events, result, ctx)
    png = tmp_path / "spikes" / "heatmap" / "step_000007.png"
    for _ in range(1200):  # training goes on while it is drawn (a flush() or finish() now would draw it here)
        if png.exists():
            break
        time.sleep(0.1)
    tracker.finish()
    assert png.read_bytes()[:4] == b"\x89PNG" and (tmp_path / "spikes" / "highlight" / "step_000007.html").exists()
    assert drawn_here == []  # not in this process: no GIL held for the training thread to wait on
    worker = render_worker._WORKER._proc
    assert worker is not None and worker.poll() is None and worker.pid != os.getpid()
    assert os.getpriority(os.PRIO_PROCESS, worker.pid) >= os.getpriority(os.PRIO_PROCESS, 0) + 1


def test_the_training_threads_own_call_and_an_unpicklable_tokenizer_are_drawn_here(spike, tmp_path, drawn_here):
    events, result, ctx = spike
    tracker = MemoryTracker()  # runs jobs inline, on the training thread: it would only wait for a worker
    SpikeArtifactWriter(tracker, tmp_path).write(7, events, result, ctx)
    assert tracker.images and drawn_here == ["MainThread"]

    class Local:  # a tokenizer defined in a function does not pickle
        def decode(self, ids):
            return "".join(chr(65 + i % 26) for i in ids)

    ctx.tokenizer, saved = Local(), ctx.tokenizer
    try:
        first = next(c for c in result.culprits if c.batch is not None)
        out = []
        t = threading.Thread(target=lambda: out.append(render_worker.draw_heatmap(result, first.batch,
                                                                                    tmp_path / "h.png", ctx)))
        t.start()
        t.join(60)
    finally:
        ctx.tokenizer = saved
    assert out and out[0].read_bytes()[:4] == b"\x89PNG" and drawn_here[-1] == t.name


@pytest.fixture
def stalled_worker(monkeypatch):
    """A worker that takes the request and never answers: the low-priority process on a saturated machine
    (3 busy processes on 2 cores gave it next to no CPU: the demo's heatmap took minutes)."""
    import subprocess
    import sys

    render_worker._WORKER.close()  # a real worker another test started: not this one's
    started = []

    def stalled():
        if render_worker._WORKER._proc is None:
            render_worker._WORKER._proc = subprocess.Popen(
                [sys.executable, "-c", "import sys, time; sys.stdin.buffer.read(); time.sleep(600)"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            started.append(render_worker._WORKER._proc)
        return render_worker._WORKER._proc

    monkeypatch.setattr(render_worker._WORKER, "_started", stalled)
    yield started
    render_worker._WORKER.close()
    monkeypatch.undo()
    assert all(p.poll() is not None for p in started)  # stopped, not left behind


@pytest.mark.parametrize("waits_in", ["finish", "flush"])
def test_a_caller_that_waits_gets_the_heatmap_drawn_on_the_trackers_thread(spike, tmp_path, drawn_here,
                                                                            stalled_worker, waits_in):
    """tracker=none: finish(), and flush() (verl's session flushes after each spike, its training thread
    waiting), hurry the render: nothing runs meanwhile to be spared, so the heatmap is drawn on the tracker's
    thread within the bound (before: the call waited out its bound and the heatmap was not made)."""
    events, result, ctx = spike
    tracker = make_tracker(TrackerConfig(kind="none"), run_dir=tmp_path)
    SpikeArtifactWriter(tracker, tmp_path).write(7, events, result, ctx)
    getattr(tracker, waits_in)(timeout_s=30)
    assert (tmp_path / "spikes" / "heatmap" / "step_000007.png").read_bytes()[:4] == b"\x89PNG"
    assert drawn_here == ["gradloc-track-local"]
    tracker.finish()


def test_a_finishing_mlflow_run_delivers_the_steps_after_a_spike(spike, tmp_path, sqlite_uri, drawn_here,
                                                                 stalled_worker):
    """The MLflow writer runs the render job in order with the metrics: a heatmap the worker never drew held
    every later step behind it until finish() gave up and spooled them (the README demo under load: steps
    100-129 missing from MLflow; here, with a quick store, the hand-over after the bound got them there).
    Hurried at finish(), the steps after the spike and its media land at once, by the writer."""
    from mlflow.tracking import MlflowClient

    from gradloc_track.trackers.run_record import read_run_views

    events, result, ctx = spike
    cfg = TrackerConfig(kind="mlflow")
    cfg.mlflow.tracking_uri = sqlite_uri
    run_dir = tmp_path / "run"
    tracker = make_tracker(cfg, run_dir=run_dir)
    writer = SpikeArtifactWriter(tracker, run_dir)
    for step in range(12):
        tracker.log_metrics({"loss": float(step)}, step)
        if step == 7:
            writer.write(7, events, result, ctx)
    t0 = time.monotonic()
    tracker.finish(timeout_s=60)
    waited = time.monotonic() - t0
    assert waited < 45, f"finish() waited {waited:.0f} s for a heatmap nobody drew (its bound: 60 s)"  # before: 60
    view = read_run_views(run_dir)["mlflow"]
    client = MlflowClient(sqlite_uri)
    assert [m.step for m in client.get_metric_history(view["run_id"], "loss")] == list(range(12))
    arts = {a.path for a in client.list_artifacts(view["run_id"], "spikes/heatmap")}
    assert arts and not list((run_dir / "spool").glob("*.jsonl"))
    assert len(drawn_here) == 1 and drawn_here[0] != "MainThread"  # drawn on the writer's thread, once
