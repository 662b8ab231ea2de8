"""Shared test setup: W&B never touches the network, torch stays on few threads."""
from __future__ import annotations

import atexit
import contextlib
import os
import sys
from pathlib import Path

import pytest
import torch

os.environ["WANDB_MODE"] = "offline"
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("WANDB_DISABLE_GIT", "true")
os.environ.setdefault("MLFLOW_ENABLE_ASYNC_LOGGING", "false")
torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[1]
CONF_DIR = ROOT / "conf"

_SESSION: dict[str, object] = {}  # the finished session; whether an exception left pytest after it


def pytest_sessionfinish(session, exitstatus):
    _SESSION["session"] = session


def _uncaught(kind, value, tb, _hook=sys.excepthook):
    _SESSION["uncaught"] = True  # (a plugin's unconfigure that raised): the exit must say it failed
    _hook(kind, value, tb)


sys.excepthook = _uncaught


def _gloo_threads() -> bool:
    """Does torch's gloo still run threads in this process? The in-process groups (ZeroRedundancyOptimizer,
    FSDP2 on one rank) leave ``gloo_tcp_loop`` / ``pt_gloo_runloop`` alive after ``destroy_process_group``."""
    try:
        names = [Path(t, "comm").read_text() for t in Path("/proc/self/task").iterdir()]
    except OSError:
        return False
    return any("gloo" in n for n in names)


@atexit.register  # registered at conftest import, before the library's and wandb's: it runs after them
def _skip_teardown_under_gloo_threads() -> None:
    """With every test done and reported, end the process without the interpreter's teardown while gloo's
    threads live: their static destructors can call std::terminate there (rc 134 after a green run), the
    teardown race every subprocess rank of the suite already skips with ``os._exit``."""
    session = _SESSION.get("session")
    if session is not None and _gloo_threads():
        sys.stdout.flush()
        sys.stderr.flush()
        status = int(session.exitstatus)  # as the last hook left it
        os._exit(max(status, 1) if _SESSION.get("uncaught") else status)


@pytest.fixture
def gloo(tmp_path):
    """A real gloo process group of one rank in this process (a file rendezvous in the test's own directory:
    gloo's FileStore deletes the file when the group is done, which a NamedTemporaryFile's own unlink then
    raced; a bounded timeout)."""
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def tiny_gpt():
    """A randomly initialised 2-layer hand-written GPT (~60k params)."""
    from gradloc_track.demo.model import TinyGPT

    torch.manual_seed(0)
    return TinyGPT(vocab_size=64, n_layer=2, n_head=2, d_model=32, max_seq_len=32)


def shared_dir(tmp_path_factory) -> Path:
    """The session's temporary folder that every pytest-xdist worker sees (each worker's own basetemp is
    a ``popen-gwN`` folder inside it); the basetemp itself without xdist."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def once_per_session(tmp_path_factory, name: str, make):
    """``make(folder)`` run once for the whole session, whichever worker asks first; the others wait for
    it and get the same JSON-able result (its files live in ``folder``). Runs that cost a minute (the
    README's demo, a gloo launch of every distributed scenario) are not paid once per worker."""
    import json
    import shutil

    from filelock import FileLock

    base = shared_dir(tmp_path_factory)
    folder, result = base / f"once-{name}", base / f"once-{name}.json"
    with FileLock(str(base / f"once-{name}.lock")):
        if not result.exists():
            shutil.rmtree(folder, ignore_errors=True)  # a failed attempt's leftovers: the retry starts clean
            folder.mkdir()
            result.write_text(json.dumps(make(folder)))
    return json.loads(result.read_text())


_STORE_TEMPLATE: list[Path] = []  # this session's store with MLflow's tables made (one file)


def new_mlflow_store(path: Path) -> str:
    """A new, empty MLflow SQLite store at ``path``; its ``sqlite:///`` URI.

    MLflow makes a store's tables on first use: ~30 schema migrations, 2.3 s on an idle core here and
    several times that on a busy one, paid again by every test that wants its own store. So the tables
    are made once per session and the file is copied (0.05 s): what a user with an existing
    ``mlflow.db`` has, opened by an untouched MLflow. The one thing MLflow wrote that depends on where it
    ran, the Default experiment's artifact location (``<cwd>/mlruns/0``), is set as a store made in
    ``path``'s folder would hold it. The README's demo (``tests/examples/demo_run.py``) keeps making
    its store from nothing, as on a fresh machine."""
    import atexit
    import shutil
    import sqlite3
    import tempfile

    if not _STORE_TEMPLATE:
        from mlflow.tracking import MlflowClient

        made = Path(tempfile.mkdtemp(prefix="gradloc-mlflow-template-")) / "mlflow.db"
        atexit.register(shutil.rmtree, made.parent, True)
        MlflowClient(f"sqlite:///{made}").search_experiments()  # makes the tables
        _STORE_TEMPLATE.append(made)
    shutil.copyfile(_STORE_TEMPLATE[0], path)
    with contextlib.closing(sqlite3.connect(path)) as db, db:
        db.execute("UPDATE experiments SET artifact_location = ? WHERE experiment_id = 0",
                   (str(path.parent / "mlruns" / "0"),))
    return f"sqlite:///{path}"


@pytest.fixture
def sqlite_uri(tmp_path, monkeypatch) -> str:
    """A new MLflow SQLite store in the test's folder (MLflow 3 refuses plain folder stores). The test
    runs in that folder: an experiment the test creates roots its artifacts at ``./mlruns``."""
    monkeypatch.chdir(tmp_path)
    return new_mlflow_store(tmp_path / "mlflow.db")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_mlflow_server(backend_uri: str, root: Path, port: int | None = None):
    """A real ``mlflow server`` on 127.0.0.1 over ``backend_uri``; yields its URI, stops at exit.

    ``port``: listen there (e.g. to restart a killed server at the address its clients know).
    """
    import subprocess
    import time
    import urllib.request

    port = port or _free_port()
    log = open(root / "server.log", "a")
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
         "--backend-store-uri", backend_uri, "--artifacts-destination", str(root / "artifacts"), "--workers", "1"],
        stdout=log, stderr=subprocess.STDOUT,
    )
    uri = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    try:
        while True:
            try:
                with urllib.request.urlopen(uri + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"mlflow server did not start: {(root / 'server.log').read_text()[-2000:]}")
            time.sleep(0.5)
        yield uri
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """A real ``mlflow server`` on 127.0.0.1 over a fresh SQLite store; yields its URI."""
    root = tmp_path_factory.mktemp("mlflow-server")
    with running_mlflow_server(f"sqlite:///{root / 'mlflow.db'}", root) as uri:
        yield uri


# -- shared by the tracker and integration tests ----------------------------------------------

@pytest.fixture(scope="session")
def _mlflow_db(tmp_path_factory) -> str:
    """ONE SQLite store for the session's MLflow tests: creating its tables costs ~15 s here."""
    return f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"


class MlflowStore:
    """The shared store, and the runs a test created in it (whatever experiment they went to)."""

    def __init__(self, uri: str) -> None:
        from mlflow.tracking import MlflowClient

        self.uri = uri
        self.client = MlflowClient(uri)
        self._before = {r.info.run_id for r in self._all()}

    def _all(self):
        exps = [e.experiment_id for e in self.client.search_experiments()]
        return self.client.search_runs(exps) if exps else []

    def new_runs(self):
        return [r for r in self._all() if r.info.run_id not in self._before]


@pytest.fixture
def mlflow_store(_mlflow_db, monkeypatch, tmp_path) -> MlflowStore:
    """MLFLOW_TRACKING_URI points at the shared store for this test (as a user's env would). The test
    runs in its own folder: MLflow roots a new experiment's artifacts at ``./mlruns`` of the working
    directory when it creates it, which left spike artifacts in the checkout's ``mlruns/``."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", _mlflow_db)
    monkeypatch.chdir(tmp_path)
    return MlflowStore(_mlflow_db)


@pytest.fixture
def temp_root(tmp_path, monkeypatch):
    """Where ``tempfile`` makes directories during the test (what a joined run must not leave behind)."""
    import tempfile

    root = tmp_path / "tmp"
    root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    return root
