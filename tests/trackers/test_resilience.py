"""A tracker that fails never stops training, and never loses a record."""
from __future__ import annotations

import subprocess
import sys
import time
import warnings

import pytest

from gradloc_track.config import TrackerConfig
from gradloc_track.trackers import MemoryTracker, Tracker, make_tracker, read_spool, replay_spool
from gradloc_track.trackers.async_writer import AsyncTracker


class AlwaysFails(Tracker):
    """Fault injection: every call raises."""

    def __init__(self):
        self.calls = 0

    def log_metrics(self, metrics, step):
        self.calls += 1
        raise ConnectionError("backend down")

    log_table = log_html = log_params = set_tags = log_metrics

    def finish(self, status="success"):
        raise ConnectionError("backend down")


def test_backend_raising_on_every_call_spools_everything(tmp_path, tiny_gpt):
    import torch

    backend = AlwaysFails()
    tracker = AsyncTracker(lambda: backend, "flaky", tmp_path, retries=2, retry_backoff_s=0.001,
                           flush_interval_s=0.05)
    from gradloc_track import GradMonitor

    mon = GradMonitor(tiny_gpt, tracker=tracker)
    opt = torch.optim.SGD(tiny_gpt.parameters(), lr=0.01)
    with pytest.warns(RuntimeWarning, match="flaky"):
        for step in range(20):
            opt.zero_grad()
            tiny_gpt(torch.randint(0, 64, (2, 8))).mean().backward()
            mon.after_backward(step)
            opt.step()
        tracker.log_table("spikes/tokens", ["a"], [[1]], 3)
        tracker.finish("success")
    recs = read_spool(tmp_path / "spool" / "flaky.jsonl")
    steps = sorted(r["args"][1] for r in recs if r["call"] == "log_metrics")
    assert steps == list(range(20))
    assert any(r["call"] == "log_table" for r in recs)
    assert backend.calls > 0
    replayed = MemoryTracker()
    replay_spool(tmp_path / "spool" / "flaky.jsonl", replayed)
    assert [s for s, _ in replayed.metrics] == list(range(20))
    assert "grad_norm/global" in replayed.metrics[0][1]


def test_unreachable_mlflow_server_does_not_block_training(tmp_path):
    """MLflow's own retry defaults (minutes per call) stay untouched: OUR timeout bounds the wait."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: nothing listens there
    cfg = TrackerConfig(kind="mlflow", open_timeout_s=1.0, call_timeout_s=1.0, finish_timeout_s=2.0)
    cfg.mlflow.tracking_uri = f"http://127.0.0.1:{port}"
    tracker = make_tracker(cfg, run_dir=tmp_path)
    for step in range(50):
        tracker.log_metrics({"loss": float(step), "token": "inf"}, step)
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tracker.finish("success")
    finish_s = time.perf_counter() - t0
    assert finish_s < cfg.finish_timeout_s + 5.0, f"finish() took {finish_s:.1f} s, bound {cfg.finish_timeout_s} s"
    recs = read_spool(tmp_path / "spool" / "mlflow.jsonl")
    logged = {}
    for r in recs:
        if r["call"] == "log_metrics":
            assert r["args"][1] not in logged, "every step spooled once"
            logged[r["args"][1]] = r["args"][0]
    assert logged == {s: {"loss": float(s), "token": "inf"} for s in range(50)}  # "inf" stays a string
    assert [r["args"] for r in recs if r["call"] == "finish"] == [["success"]]


def test_full_queue_spills_instead_of_blocking(tmp_path):
    import threading

    gate = threading.Event()

    class Slow(MemoryTracker):
        def log_metrics(self, metrics, step):
            gate.wait(5)
            super().log_metrics(metrics, step)

    inner = Slow()
    tracker = AsyncTracker(lambda: inner, "slow", tmp_path, queue_size=2, put_timeout_s=0.001)
    with pytest.warns(RuntimeWarning, match="queue full"):
        for step in range(30):
            tracker.log_metrics({"x": float(step)}, step)
    gate.set()
    tracker.finish()
    spooled = {r["args"][1] for r in read_spool(tmp_path / "spool" / "slow.jsonl")}
    written = {s for s, _ in inner.metrics}
    assert spooled | written == set(range(30))


def test_import_needs_neither_backend():
    code = "import sys, gradloc_track, gradloc_track.trackers, gradloc_track.monitor; " \
           "print('wandb' in sys.modules, 'mlflow' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


@pytest.mark.parametrize("kind", ["wandb", "mlflow"])
def test_missing_backend_names_the_extra(kind):
    code = (f"import sys; sys.modules[{kind!r}] = None\n"
            "from gradloc_track.config import TrackerConfig\n"
            "from gradloc_track.trackers import make_tracker\n"
            f"make_tracker(TrackerConfig(kind={kind!r}))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode != 0
    assert f"pip install 'gradloc-track[{kind}]'" in proc.stderr


def test_config_errors_name_the_field():
    from gradloc_track.config import ConfigError

    with pytest.raises(ConfigError, match="tracker.kind"):
        TrackerConfig(kind="neptune")
    with pytest.raises(ConfigError, match="tracker.queue_size"):
        TrackerConfig(queue_size=0)
