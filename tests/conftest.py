"""Shared test setup: W&B never touches the network, torch stays on few threads."""
from __future__ import annotations

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


@pytest.fixture
def tiny_gpt():
    """A randomly initialised 2-layer hand-written GPT (~60k params)."""
    from gradloc_track.demo.model import TinyGPT

    torch.manual_seed(0)
    return TinyGPT(vocab_size=64, n_layer=2, n_head=2, d_model=32, max_seq_len=32)


@pytest.fixture
def sqlite_uri(tmp_path) -> str:
    """A fresh MLflow SQLite store (MLflow 3 refuses plain folder stores)."""
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


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
