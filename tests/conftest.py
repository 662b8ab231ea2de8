"""Shared test setup: W&B never touches the network, torch stays on few threads."""
from __future__ import annotations

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
