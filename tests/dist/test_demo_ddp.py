"""The example app on 2 DDP processes (torchrun): a garbage document injected into rank 1's batch
is detected on every rank, localized collectively, and rank 0's MLflow run names rank 1 and the
token text (rank 1 sent its token ids; rank 0 decoded them)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gradloc_track.artifacts import read_table
from ..conftest import ROOT
from .launch import free_port

STEP = 100
ARGS = ["tracker=mlflow", "train.steps=103", "train.batch_size=4", "train.seq_len=128", "model.n_layer=1",
        "model.d_model=32", "model.n_head=2", "model.max_seq_len=128", "train.num_threads=1",
        "train.loss_norm=sample", f"train.inject.step={STEP}", "train.inject.sample=1", "train.inject.span=2",
        "train.inject.rank=1", "spikes.warmup_steps=80", "spikes.ratio_thresh=3.0", "optim.lr=2e-3"]


@pytest.mark.slow
def test_spike_on_rank1_is_localized_and_shown_with_rank_and_text(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "MLFLOW_TRACKING_URI": uri}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", free_port(),
           str(ROOT / "examples" / "train_lm.py"), f"out_dir={tmp_path / 'runs'}", f"tracker.mlflow.tracking_uri={uri}",
           *ARGS]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (summary,) = [json.loads(p.read_text()) for p in (tmp_path / "runs").rglob("summary.json")]  # rank 0 only
    assert STEP in summary["events_at"]

    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("gradloc-track").experiment_id])  # one run
    local = Path(client.download_artifacts(run.info.run_id, "spikes", str(tmp_path / "dl")))
    table = read_table(local.parent, "spikes/tokens")
    rows = [dict(zip(table["columns"], r)) for r in table["data"]]
    rows = [r for r in rows if r["step"] == STEP]
    # the two injected loss terms of sample 1 on rank 1, and nothing else
    assert {(r["rank"], r["rank_sample"], r["position"]) for r in rows} == {(1, 1, 0), (1, 1, 1)}
    for r in rows:  # bytes >= 0xC0 never occur in the corpus: decoded from rank 1's ids on rank 0
        assert r["token_id"] >= 0xC0 and r["token"] not in ("", f"<{r['token_id']}>")
    html = (local / "highlight" / f"step_{STEP:06d}.html").read_text()
    assert all(r["token"] in html or r["token"].replace("\\", "&#92;") in html for r in rows)
    assert "<h2>rank 1, sample 1</h2>" in html  # the gathered row named as the console names it: its rank's sample
