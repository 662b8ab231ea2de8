"""Tracker outages end to end (issue 13), against a REAL ``mlflow server`` with MLflow's DEFAULT retries.

A server dead from the start, killed mid-run, or unreachable; a SIGTERM mid-run: training is not
slowed, ``finish()`` keeps its bound, and ``gradloc-track replay`` completes the ORIGINAL run.
The writer's own fault handling (hung, failing, slow backends, an unwritable spool) is tested
without a server in ``tests/trackers/test_async_writer.py``.

Nothing here sets ``MLFLOW_HTTP_REQUEST_*``: with the defaults one call to a dead server takes
~4 minutes, and our own bounds (``tracker.call_timeout_s``/``open_timeout_s``/``finish_timeout_s``)
are what keep training and shutdown moving. One store and one port per module: the server is
stopped and restarted on them as each scenario needs (its start is the slow part).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest

from gradloc_track.cli import main as cli
from gradloc_track.config import TrackerConfig
from gradloc_track.trackers import MemoryTracker, make_tracker, read_spool
from gradloc_track.trackers.run_record import read_backend_record

from ..conftest import ROOT, _free_port, running_mlflow_server
from ..trackers.faults import timed_finish
from ..trackers.faults import train as train_steps
from .slow_proxy import SlowProxy

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
    """The tiny training loop, ``STEPS`` steps; returns its wall time."""
    return train_steps(tracker, steps, at_step)


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
    assert dead_s < 2 * baseline_s + 10.0, "a dead server must not slow training down (a wait would be >= 30 s)"
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
    assert run_s < 2 * baseline_s + 10.0, "the killed server must not slow training down"
    run_id = read_backend_record(tmp_path, "mlflow")["run"]["run_id"]
    spooled = spooled_steps(tmp_path)
    finals = [r["args"] for r in read_spool(tmp_path / "spool" / "mlflow.jsonl") if r["call"] == "finish"]
    assert finals == [["success"]]

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


def run_against(uri: str, run_dir, steps: int, caplog) -> tuple[float, str]:
    """An MLflow tracker at ``uri`` (every default), ``steps`` metrics and finish(): (seconds, what was said)."""
    import logging

    cfg = TrackerConfig(kind="mlflow")
    cfg.mlflow.tracking_uri = uri
    t0 = time.perf_counter()
    with caplog.at_level(logging.WARNING), warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        tracker = make_tracker(cfg, run_dir=run_dir)
        for step in range(steps):
            tracker.log_metrics({"loss": float(step)}, step)
        tracker.finish("success")
    return time.perf_counter() - t0, caplog.text + " ".join(str(w.message) for w in said)


def test_a_server_that_is_not_running_is_said_at_once_with_its_address(tmp_path, caplog, capsys):
    """Every default as a user has it (ours and MLflow's): a refused connection is known at the first connect.
    Before, MLflow's retries ran out our whole open bound (120 s) and the warning said only "no answer
    within 120 s"; now the run is spooled at once, the warning names the address and the fix, and finish()
    does not wait for a server nobody started."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: nothing listens there
    took, told = run_against(f"http://127.0.0.1:{port}", tmp_path, 20, caplog)
    assert took < 30, f"{took:.0f} s for a server that refuses at once (MLflow's retries: ~120 s)"
    assert f"refused the connection: nothing listens on 127.0.0.1:{port}" in told
    assert "tracker.mlflow.tracking_uri" in told
    recs = read_spool(tmp_path / "spool" / "mlflow.jsonl")
    assert sorted(r["args"][1] for r in recs if r["call"] == "log_metrics") == list(range(20))  # nothing lost
    assert [r["args"] for r in recs if r["call"] == "finish"] == [["success"]]
    # replay while the server is still down: said in two lines with replay's own option, not a traceback
    from gradloc_track.cli import main

    assert main(["replay", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "refused the connection" in err and "--tracking-uri" in err and "Traceback" not in err
    assert read_spool(tmp_path / "spool" / "mlflow.jsonl") == recs  # kept for the next try


def test_a_sqlite_store_that_cannot_be_created_is_said_at_once_with_its_path(tmp_path, caplog):
    """MLflow retries a SQLite file it cannot open for about two minutes ('unable to open database file', a
    warning per retry): the run waited out its open bound and the cause named neither the path nor the setting
    (held-out tester round 6). Now said at once, naming both; every record spooled. SDK defaults."""

    (tmp_path / "a_file").write_text("not a folder")
    folder = tmp_path / "a_file" / "sub"
    took, told = run_against(f"sqlite:///{folder / 'mlflow.db'}", tmp_path / "run", 10, caplog)
    assert took < 30, f"{took:.0f} s for a store that cannot be created (MLflow's retries: ~120 s)"
    assert f"{tmp_path / 'a_file'} is a file, not a folder" in told and "tracker.mlflow.tracking_uri" in told
    recs = read_spool(tmp_path / "run" / "spool" / "mlflow.jsonl")
    assert sorted(r["args"][1] for r in recs if r["call"] == "log_metrics") == list(range(10))


@pytest.mark.parametrize("scheme", ["http", "https"])
def test_a_web_server_that_is_not_mlflow_is_said_at_once(tmp_path, caplog, scheme):
    """A real web server (the stdlib's, serving a folder) where the MLflow server should be: http:// printed
    MLflow's raw 404 page per retry, https:// to it waited out the open bound on its TLS handshake; neither
    named the setting (held-out tester round 6). Now said at once; every record spooled. SDK defaults."""
    import functools
    import threading
    from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

    handler = functools.partial(SimpleHTTPRequestHandler, directory=str(tmp_path))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        took, told = run_against(f"{scheme}://127.0.0.1:{server.server_address[1]}", tmp_path / "run", 10, caplog)
    finally:
        server.shutdown()
        server.server_close()
    assert took < 30, f"{took:.0f} s for a server that is not MLflow"
    said = "answers, but not as an MLflow tracking server" if scheme == "http" else "the TLS handshake failed"
    assert said in told and "tracker.mlflow.tracking_uri" in told
    recs = read_spool(tmp_path / "run" / "spool" / "mlflow.jsonl")
    assert sorted(r["args"][1] for r in recs if r["call"] == "log_metrics") == list(range(10))


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


def test_a_slow_server_receives_every_step_while_training_runs(server, tmp_path, capsys):
    """Each request held 0.5 s, a step every ~0.05 s: one request carries many steps, in order."""
    proxy = SlowProxy(server.up(), delay_s=0.5)
    cfg = tracker_config(proxy.uri, "slow-server")
    cfg.call_timeout_s, cfg.finish_timeout_s = 10.0, 10.0
    tracker = make_tracker(cfg, run_dir=tmp_path)
    try:
        train(tracker, steps=100, at_step=lambda step: time.sleep(0.05))
        run_id = read_backend_record(tmp_path, "mlflow").get("run", {}).get("run_id")
        during = len(backend_steps(server, run_id)) if run_id else 0
        finish_s = timed_finish(tracker)
    finally:
        proxy.close()
    run_id = read_backend_record(tmp_path, "mlflow")["run"]["run_id"]
    with capsys.disabled():
        print(f"\nslow server (0.5 s a request): {during}/100 steps there when training ended, finish() "
              f"{finish_s:.2f} s, {proxy.batches()} log-batch requests")
    assert not (tmp_path / "spool").exists(), "nothing left for replay"
    assert backend_steps(server, run_id) == list(range(100))
    assert proxy.batches() < 50, "many steps per request"
    assert server.client().get_run(run_id).info.status == "FINISHED"


def test_a_run_created_after_finish_gave_up_is_ended_and_never_recorded(server, tmp_path, monkeypatch):
    """The server answers the run creation only after finish() gave up and replay made the run: that
    late run is ended (and deleted), the run dir keeps pointing at the replayed one."""
    from mlflow.tracking import MlflowClient

    from gradloc_track.report import build_report

    server.up()
    real, release, calls, late = MlflowClient.create_run, threading.Event(), [], []

    def answers_late(self, *args, **kwargs):  # the first creation: no answer until released
        calls.append(1)
        if len(calls) == 1:
            release.wait(60)
            run = real(self, *args, **kwargs)
            late.append(run.info.run_id)
            return run
        return real(self, *args, **kwargs)
    monkeypatch.setattr(MlflowClient, "create_run", answers_late)
    cfg = tracker_config(server.uri, "late-run")
    cfg.open_timeout_s, cfg.finish_timeout_s = 1.0, 2.0
    tracker = make_tracker(cfg, run_dir=tmp_path)
    train(tracker, steps=10)
    tracker.log_table("spikes/tokens", ["step", "token"], [[5, "bad"]], 5)
    tracker.log_html("spikes/highlight", "<html><title>spike at step 5</title></html>", 5)
    finish_s = timed_finish(tracker)
    assert finish_s < cfg.finish_timeout_s + 5.0
    assert cli(["replay", str(tmp_path)]) == 0  # the server is back: the run is made from the spool
    replayed = read_backend_record(tmp_path, "mlflow")["run"]["run_id"]
    release.set()  # ...and only now the stuck creation gets its answer
    deadline = time.time() + 60
    while not late or server.client().get_run(late[0]).info.lifecycle_stage != "deleted":
        assert time.time() < deadline, "the late run was never ended"
        time.sleep(0.2)
    assert server.client().get_run(late[0]).info.status == "KILLED"
    exp = server.client().get_experiment_by_name("late-run")
    assert [r.info.run_id for r in server.client().search_runs([exp.experiment_id])] == [replayed]
    record = read_backend_record(tmp_path, "mlflow")
    assert record["run"]["run_id"] == record["view"]["run_id"] == replayed
    assert backend_steps(server, replayed) == list(range(10))
    assert replayed in build_report(tmp_path)  # `gradloc-track report <run dir>` opens the replayed run


KILL9_SCRIPT = """
import os, signal, sys
sys.path.insert(0, {root!r})
from gradloc_track.config import TrackerConfig
from gradloc_track.trackers import make_tracker

cfg = TrackerConfig(kind="mlflow")
cfg.mlflow.tracking_uri, cfg.mlflow.experiment_name = sys.argv[1], "kill9"
tracker = make_tracker(cfg, run_dir=sys.argv[2])
for step in range(30):
    tracker.log_metrics({{"loss": float(step)}}, step)
tracker.flush()
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_replay_ends_a_run_whose_process_was_killed(server, tmp_path, capsys):
    uri = server.up()
    script = tmp_path / "train.py"
    script.write_text(KILL9_SCRIPT.format(root=str(ROOT)))
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, str(script), uri, str(run_dir)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    run_id = read_backend_record(run_dir, "mlflow")["run"]["run_id"]
    assert server.client().get_run(run_id).info.status == "RUNNING"  # nothing in the process could end it
    out = replay(run_dir, capsys)
    assert f"mlflow run {run_id}" in out and "ended as KILLED" in out
    run = server.client().get_run(run_id)
    assert run.info.status == "KILLED" and len(server.client().get_metric_history(run_id, "loss")) == 30
    out = replay(run_dir, capsys)  # idempotent
    assert "ended" not in out and server.client().get_run(run_id).info.status == "KILLED"


def test_ctrl_c_ends_the_run_killed(server, tmp_path):
    cfg = tracker_config(server.up(), "ctrl-c")
    with pytest.raises(KeyboardInterrupt):
        with make_tracker(cfg, run_dir=tmp_path / "with") as in_with:  # the context manager
            train(in_with, steps=3)
            raise KeyboardInterrupt
    tracker = make_tracker(cfg, run_dir=tmp_path / "except")
    try:  # the usual loop: finish("failed") on any exception
        train(tracker, steps=3)
        raise KeyboardInterrupt
    except BaseException:
        tracker.finish("failed")
    for run_dir in ("with", "except"):
        run_id = read_backend_record(tmp_path / run_dir, "mlflow")["run"]["run_id"]
        assert server.client().get_run(run_id).info.status == "KILLED", run_dir


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI for a self-signed certificate")
@pytest.mark.parametrize("speaks_mlflow", [True, False], ids=["mlflow-api", "another-server"])
def test_an_https_server_with_a_self_signed_certificate_is_left_to_the_sdks_trust(tmp_path, speaks_mlflow):
    """Whom to trust is MLflow's settings' (``MLFLOW_TRACKING_INSECURE_TLS``, a custom CA), not the probe's: a
    self-signed server that answers MLflow's API passes (before: refused as 'the TLS handshake failed ... use
    http://', reviewer round 8), and one that answers 404 is still said to be another server."""
    import json
    import ssl
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from gradloc_track.trackers.reachable import check_server

    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-keyout", str(tmp_path / "key.pem"), "-out", str(tmp_path / "cert.pem")],
                   check=True, capture_output=True, timeout=60)

    class Api(BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"experiments": []}).encode()
            self.send_response(200 if speaks_mlflow else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Api)
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(tmp_path / "cert.pem", tmp_path / "key.pem")
    server.socket = tls.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    uri = f"https://127.0.0.1:{server.server_address[1]}"
    try:
        if speaks_mlflow:
            check_server(uri)
        else:
            with pytest.raises(ConnectionError, match="not as an MLflow tracking server"):
                check_server(uri)
    finally:
        server.shutdown()
        server.server_close()
