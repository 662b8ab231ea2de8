"""Demo runs for the ledger tests: the real app through Hydra, MLflow into a temp SQLite store.

One module-scoped pair of runs (seeds 0 and 1, the same garbled answer injected at step 100)
serves every ledger test; each run is ~3 s (1 layer, 103 steps, the BPE trained once per session).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ..conftest import ROOT

SCRIPT = ROOT / "examples" / "train_lm.py"
INJECT = 100
# the spike demo, small: a garbled answer (2 loss tokens of mojibake) in sample 1 of step 100
FAST = ["train.steps=103", "train.batch_size=4", "train.seq_len=128", "model.max_seq_len=128", "model.n_layer=1",
        "model.d_model=32", "model.n_head=2", "train.num_threads=1", "train.loss_norm=sample",
        f"train.inject.step={INJECT}", "train.inject.sample=1", "train.inject.kind=garbled_span",
        "train.inject.span=2", "spikes.warmup_steps=80", "spikes.ratio_thresh=3.0", "optim.lr=2e-3",
        "train.tokenizer=bpe", "model.vocab_size=1024"]


@pytest.fixture(scope="session")
def bpe_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("bpe-cache")


def demo_run(root: Path, cache: Path, *overrides: str, check: bool = True) -> subprocess.CompletedProcess:
    """``examples/train_lm.py`` as a user runs it, logging to ``root/mlflow.db``."""
    uri = f"sqlite:///{root / 'mlflow.db'}"
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "WANDB_MODE": "offline", "WANDB_SILENT": "true",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run([sys.executable, str(SCRIPT), f"out_dir={root / 'runs'}", "tracker=mlflow",
                           f"tracker.mlflow.tracking_uri={uri}", f"train.cache_dir={cache}", *FAST, *overrides],
                          cwd=root, env=env, capture_output=True, text=True, timeout=600)
    if check and proc.returncode != 0:
        raise AssertionError(f"train_lm failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def run_dir_of(proc: subprocess.CompletedProcess) -> Path:
    """The run dir the app printed."""
    (line,) = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.startswith("run dir: ")]
    return Path(line[len("run dir: "):].strip())


def summary_of(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory, bpe_cache):
    """Two demo runs (seeds 0, 1) with the same injected document: (root, [run dirs])."""
    root = tmp_path_factory.mktemp("ledger")
    dirs = [run_dir_of(demo_run(root, bpe_cache, f"train.seed={seed}", f"run_name=seed{seed}")) for seed in (0, 1)]
    for d in dirs:
        assert INJECT in summary_of(d)["events_at"], "the injected document must spike in both runs"
    return root, dirs
