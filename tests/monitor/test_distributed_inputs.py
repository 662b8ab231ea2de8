"""Each rank's losses are its own; the detector's decision must not be (a localization started on one
rank alone hangs the others). 2 and 4 processes on gloo: every rank's detector reads the same combined
values, equal to one process's over the whole batch, and fires on the same steps."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from . import dist_inputs_worker as worker
from .dist_worker import build, global_batch
from .test_distributed import free_port

WORKER = Path(worker.__file__)


@pytest.mark.parametrize("world", [2, 4])
def test_every_rank_reads_the_same_losses_and_fires_alike(tmp_path, world):
    out = tmp_path / "rank"
    port = free_port()
    root = Path(__file__).resolve().parents[2]
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(r), str(world), port, str(out)], cwd=root,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(world)]
    logs = [p.communicate(timeout=240)[0] for p in procs]  # a hang fails here, not forever
    assert all(p.returncode == 0 for p in procs), "\n".join(f"--- rank {r} ---\n{log[-2000:]}"
                                                          for r, log in enumerate(logs))
    ranks = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(world)]
    assert all(r["fed"] == ranks[0]["fed"] and r["events"] == ranks[0]["events"] for r in ranks)
    assert ranks[0]["gathers"] == worker.STEPS  # ONE all-gather a step for the losses
    # one process over the whole batch (the same model, both ranks' samples)
    loss, samples, junk, _ = worker.local_inputs(build(), global_batch())
    fed = ranks[0]["fed"]
    for step, f in enumerate(fed):
        assert f["loss"] == pytest.approx(float(loss), rel=1e-5)
        assert f["junk_span"] == [pytest.approx(float(junk.span), rel=1e-5), pytest.approx(float(junk.mean), rel=1e-5),
                                  pytest.approx(float(junk.leak), rel=1e-6)]  # the largest over every rank's rows
        if step == worker.SPIKE_AT:
            assert f["sample_losses"] == [100.0]
        elif step == worker.MISSING_AT:  # rank 1 gave none: the others' alone
            rest = max(max(r["local"]["samples"]) for i, r in enumerate(ranks) if i != 1)
            assert f["sample_losses"] == [pytest.approx(rest, rel=1e-6)]
        else:
            assert f["sample_losses"] == [pytest.approx(float(samples.max()), rel=1e-5)]
    # rank 1's sample alone made the spike: rank 0 fires on it too, and nothing else fires anywhere
    assert ranks[0]["events"] == [["sample_loss"] if i == worker.SPIKE_AT else [] for i in range(worker.STEPS)]
    assert ranks[0]["local"]["samples"] != ranks[1]["local"]["samples"]  # the ranks' own values differ
