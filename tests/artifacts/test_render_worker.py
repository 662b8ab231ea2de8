"""The spike heatmap drawn off the training process's GIL (issue 38 item 4): a tracker that runs jobs on a
thread of its own hands the drawing to a low-priority worker process; the training thread's own calls, and
what cannot be pickled, are drawn in this process as before."""
from __future__ import annotations

import os
import threading

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
    tracker.finish()
    png = tmp_path / "spikes" / "heatmap" / "step_000007.png"
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
