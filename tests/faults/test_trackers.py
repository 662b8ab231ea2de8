"""Tracker faults (issue 13), against a REAL ``mlflow server`` with MLflow's DEFAULT retries.

Nothing here sets ``MLFLOW_HTTP_REQUEST_*``: with the defaults one call to a dead server takes
~4 minutes, and our own bounds (``tracker.call_timeout_s``/``open_timeout_s``/``finish_timeout_s``)
are what keep training and shutdown moving. One store and one port per module: the server is
stopped and restarted on them as each scenario needs (its start is the slow part).
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

from gradloc_track import GradMonitor
from gradloc_track.cli import main as cli
from gradloc_track.config import TrackerConfig
from gradloc_track.trackers import MemoryTracker, files, make_tracker, read_spool
from gradloc_track.trackers.async_writer import AsyncTracker
from gradloc_track.trackers.run_record import read_backend_record

from ..conftest import ROOT, _free_port, running_mlflow_server

STEPS = 120
assert not any(k.startswith("MLFLOW_HTTP_REQUEST") for k in os.environ), "tests must use MLflow's defaults"


class Server:
    """A real mlflow server on a fixed port over one SQLite store: start, stop, start again."""

    def __init__(self, root: Path) -> None:
        self.root, self.port = root, _free_port()
        self.store = f"sqlite:///{root / 'mlflow.db'}"
        self.uri = f"http://127.0.0.1:{self.port}"
        self._cm: contextlib.AbstractContextManager | None = None
        self._client = None

    def up(self) -> str:
        if self._cm is None:
            self._cm = running_mlflow_server(self.store, self.root, port=self.port)
            assert self._cm.__enter__() == self.uri
        return self.uri

    def down(self) -> None:
        if self._cm is not None:
            cm, self._cm = self._cm, None
            cm.__exit__(None, None, None)

    def client(self):
        """A client of the running server (opening the SQLite store directly takes a minute on a busy box)."""
        if self._client is None:
            from mlflow.tracking import MlflowClient

            self._client = MlflowClient(self.uri)
        return self._client


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("mlflow-faults"))
    yield srv
    srv.down()


def tracker_config(uri: str, experiment: str) -> TrackerConfig:
    # OUR bounds, short for the test; MLflow's own retries stay at their defaults
    cfg = TrackerConfig(kind="mlflow", call_timeout_s=2.0, open_timeout_s=30.0, finish_timeout_s=5.0,
                        probe_interval_s=600.0)
    cfg.mlflow.tracking_uri = uri
    cfg.mlflow.experiment_name = experiment
    return cfg


def train(tracker, steps: int = STEPS, at_step=None) -> float:
    """A real (tiny) training loop logging every step; returns the loop's wall time (without ``at_step``)."""
    from gradloc_track.demo.model import TinyGPT

    torch.manual_seed(0)
    model = TinyGPT(vocab_size=64, n_layer=2, n_head=2, d_model=32, max_seq_len=16)
    monitor = GradMonitor(model, tracker=tracker, log_every=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    t0 = time.perf_counter()
    for step in range(steps):
        if at_step is not None:
            t_hook = time.perf_counter()
            at_step(step)
            t0 += time.perf_counter() - t_hook
        opt.zero_grad()
        model(x).mean().backward()
        monitor.after_backward(step)
        opt.step()
    return time.perf_counter() - t0


def timed_finish(tracker, status="success") -> float:
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tracker.finish(status)
    return time.perf_counter() - t0


def spooled_steps(run_dir: Path) -> list[int]:
    path = run_dir / "spool" / "mlflow.jsonl"
    recs = read_spool(path) if path.exists() else []
    return [r["args"][1] for r in recs if r["call"] == "log_metrics" and "grad_norm/global" in r["args"][0]]


def backend_steps(server: Server, run_id: str) -> list[int]:
    return sorted(m.step for m in server.client().get_metric_history(run_id, "grad_norm/global"))


def replay(run_dir: Path, capsys) -> str:
    assert cli(["replay", str(run_dir)]) == 0
    return capsys.readouterr().out


def test_server_dead_from_the_start(server, tmp_path, capsys):
    server.down()
    baseline_s = train(MemoryTracker())
    cfg = tracker_config(server.uri, "dead-from-start")
    tracker = make_tracker(cfg, run_dir=tmp_path)
    dead_s = train(tracker)
    finish_s = timed_finish(tracker)
    with capsys.disabled():
        print(f"\nloop: {baseline_s:.2f} s in memory, {dead_s:.2f} s with the server dead; finish() {finish_s:.2f} s")
    assert dead_s < 2 * baseline_s + 3.0, "a dead server must not slow training down (a wait would be >= 30 s)"
    assert finish_s < cfg.finish_timeout_s + 5.0, f"finish() took {finish_s:.1f} s, bound {cfg.finish_timeout_s} s"
    assert sorted(spooled_steps(tmp_path)) == list(range(STEPS))  # every step, once
    assert "run" not in read_backend_record(tmp_path, "mlflow")  # the server never answered: no run yet

    server.up()
    out = replay(tmp_path, capsys)
    run_id = read_backend_record(tmp_path, "mlflow")["run"]["run_id"]
    assert f"mlflow run {run_id}: replayed" in out and "final status success" in out
    run = server.client().get_run(run_id)
    assert run.info.status == "FINISHED"
    assert backend_steps(server, run_id) == list(range(STEPS))

    out = replay(tmp_path, capsys)  # a second replay changes nothing
    assert "replayed 0 record(s)" in out
    assert backend_steps(server, run_id) == list(range(STEPS))
    exp = server.client().get_experiment_by_name("dead-from-start")
    assert len(server.client().search_runs([exp.experiment_id])) == 1


def test_server_killed_mid_run_and_never_restarted(server, tmp_path, capsys):
    uri = server.up()
    baseline_s = train(MemoryTracker())
    cfg = tracker_config(uri, "killed-mid-run")
    tracker = make_tracker(cfg, run_dir=tmp_path)

    def kill_at_100(step):
        if step == STEPS // 2:
            tracker.flush()  # the first half reached the server
            server.down()

    run_s = train(tracker, at_step=kill_at_100)
    finish_s = timed_finish(tracker)
    with capsys.disabled():
        print(f"\nloop: {baseline_s:.2f} s in memory, {run_s:.2f} s with the server killed at step {STEPS // 2}; "
              f"finish() {finish_s:.2f} s")
    assert finish_s < cfg.finish_timeout_s + 5.0, f"finish() took {finish_s:.1f} s, bound {cfg.finish_timeout_s} s"
    assert run_s < 2 * baseline_s + 3.0, "the killed server must not slow training down"
    run_id = read_backend_record(tmp_path, "mlflow")["run"]["run_id"]
    spooled = spooled_steps(tmp_path)
    assert [r["args"] for r in read_spool(tmp_path / "spool" / "mlflow.jsonl") if r["call"] == "finish"] == [["success"]]

    server.up()  # the same store, at the address the run directory recorded
    before = backend_steps(server, run_id)
    assert before and spooled, "both halves: some steps in the server, the rest in the spool"
    assert sorted(set(before) | set(spooled)) == list(range(STEPS))
    assert len(spooled) == len(set(spooled)) and len(before) == len(set(before))
    assert server.client().get_run(run_id).info.status == "RUNNING"  # the status is in the spool
    out = replay(tmp_path, capsys)
    assert f"mlflow run {run_id}" in out and "final status success" in out
    assert server.client().get_run(run_id).info.status == "FINISHED"
    assert backend_steps(server, run_id) == list(range(STEPS))  # exactly once, the original run
    assert "replayed 0 record(s)" in replay(tmp_path, capsys)
    assert backend_steps(server, run_id) == list(range(STEPS))
    exp = server.client().get_experiment_by_name("killed-mid-run")
    assert len(server.client().search_runs([exp.experiment_id])) == 1


SIGTERM_SCRIPT = """
import os, signal, sys
sys.path.insert(0, {root!r})
import torch
from gradloc_track import GradMonitor
from gradloc_track.config import TrackerConfig
from gradloc_track.demo.model import TinyGPT
from gradloc_track.trackers import make_tracker

cfg = TrackerConfig(kind="mlflow", finish_timeout_s=30.0)
cfg.mlflow.tracking_uri, cfg.mlflow.experiment_name = sys.argv[1], "sigterm"
tracker = make_tracker(cfg, run_dir=sys.argv[2])
torch.manual_seed(0)
model = TinyGPT(vocab_size=64, n_layer=2, n_head=2, d_model=32, max_seq_len=16)
monitor = GradMonitor(model, tracker=tracker, log_every=1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randint(0, 64, (2, 16))
try:
    for step in range(200):
        if step == 80:
            os.kill(os.getpid(), signal.SIGTERM)  # the scheduler preempts us here
        opt.zero_grad()
        model(x).mean().backward()
        monitor.after_backward(step)
        opt.step()
except BaseException:
    tracker.finish("failed")
    raise
tracker.finish("success")
print("not reached")
"""


def test_sigterm_ends_the_run_killed_with_every_step(server, tmp_path):
    uri = server.up()
    script = tmp_path / "train.py"
    script.write_text(SIGTERM_SCRIPT.format(root=str(ROOT)))
    proc = subprocess.run([sys.executable, str(script), uri, str(tmp_path / "run")], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == -signal.SIGTERM, proc.stderr[-3000:]  # still dies of SIGTERM (chained)
    assert "not reached" not in proc.stdout
    run_id = read_backend_record(tmp_path / "run", "mlflow")["run"]["run_id"]
    assert server.client().get_run(run_id).info.status == "KILLED"
    assert backend_steps(server, run_id) == list(range(80))
    assert not (tmp_path / "run" / "spool").exists(), "the server was up: nothing spooled"


class RecoversAtStep(MemoryTracker):
    """Fault injection: every call fails until a metric of step >= ``step`` arrives."""

    def __init__(self, step: int) -> None:
        super().__init__()
        self.recover_at, self.up = step, False

    def _check(self):
        if not self.up:
            raise ConnectionError("backend down")

    def log_metrics(self, metrics, step):
        self.up = self.up or step >= self.recover_at
        self._check()
        super().log_metrics(metrics, step)

    def log_params(self, params):
        self._check()
        super().log_params(params)


@pytest.fixture
def full_disk(tmp_path, monkeypatch):
    """A directory on a full disk: a tiny tmpfs filled up when we may mount one, else ENOSPC
    injected in our write functions. Yields (dir, free) where ``free()`` makes room again."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = os.geteuid() == 0 and subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(disk)],
                                                   capture_output=True).returncode == 0
    if mounted:
        filler = disk / "filler"
        for chunk in (4096, 1):  # pages, then whatever a partial page still holds
            with open(filler, "ab", buffering=0) as f, contextlib.suppress(OSError):
                while True:
                    f.write(b"\0" * chunk)

        def free():
            filler.unlink()
    else:
        state = {"full": True}
        real_append, real_write = files.append_line, files.atomic_write_bytes

        def failing(real):
            def write(path, data):
                if state["full"] and str(path).startswith(str(disk)):
                    raise OSError(errno.ENOSPC, "No space left on device (injected)", str(path))
                return real(path, data)
            return write
        monkeypatch.setattr(files, "append_line", failing(real_append))
        monkeypatch.setattr(files, "atomic_write_bytes", failing(real_write))

        def free():
            state["full"] = False
    yield disk, free
    if mounted:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def _flaky_async(backend, run_dir) -> AsyncTracker:
    return AsyncTracker(lambda: backend, "flaky", run_dir, retries=0, call_timeout_s=2.0, finish_timeout_s=5.0,
                        probe_interval_s=0.0, flush_interval_s=0.01)


@pytest.mark.parametrize("where", ["run dir is a file", "spool on a full disk"])
def test_unwritable_spool_counts_what_was_lost(where, tmp_path, full_disk):
    disk, _ = full_disk
    if where == "run dir is a file":
        (tmp_path / "not_a_dir").write_text("x")
        run_dir = tmp_path / "not_a_dir" / "run"
    else:
        run_dir = disk / "run"
    backend = RecoversAtStep(20)
    tracker = _flaky_async(backend, run_dir)
    with pytest.warns(RuntimeWarning) as caught:
        train(tracker, steps=40, at_step=lambda s: tracker.flush())
        t_finish = timed_finish(tracker)
    assert t_finish < tracker.finish_timeout_s + 5.0
    messages = " ".join(str(w.message) for w in caught)
    assert "LOST" in messages and "tracker/dropped" in messages
    assert tracker.dropped == 20  # steps 0-19: neither the backend nor the spool took them
    assert [s for s, _ in backend.metrics if "grad_norm/global" in _] == list(range(20, 40))
    assert backend.series("tracker/dropped")[0] == (20, 20.0)  # reported with the first step that got through


def test_tracker_none_on_a_full_disk_never_stops_training(tmp_path, full_disk):
    disk, free = full_disk
    tracker = make_tracker(TrackerConfig(kind="none"), run_dir=disk / "run")
    with pytest.warns(RuntimeWarning, match="tracker/dropped"):
        train(tracker, steps=20)
    assert tracker.dropped >= 20
    lost = tracker.dropped
    free()
    tracker.log_metrics({"loss": 1.0}, 20)
    tracker.finish("success")
    lines = [json.loads(line) for line in (disk / "run" / "metrics.jsonl").read_text().splitlines()]
    assert lines[0] == {"step": 20, "metrics": {"loss": 1.0, "tracker/dropped": float(lost)}}
    assert json.loads((disk / "run" / "tags.json").read_text())["status"] == "success"
