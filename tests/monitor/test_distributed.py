"""2 processes on gloo: DDP and FSDP2 (DTensor) gradients give the single-process norms."""
from __future__ import annotations

import json
import math
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from . import dist_worker

WORKER = Path(dist_worker.__file__)


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def reference():
    """Single process, full batch (mean loss over the same 4 samples), plain per-parameter loop."""
    model = dist_worker.build()
    dist_worker.loss_of(model, dist_worker.global_batch()).backward()
    pre = {n: p.grad.double().norm().item() for n, p in model.named_parameters()}
    total = math.sqrt(sum(v * v for v in pre.values()))
    coef = min(1.0, 0.5 / (total + 1e-6))  # AdaGC warm-up step = global clip at lambda_abs
    return pre, {n: v * coef for n, v in pre.items()}


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_two_process_norms_match_single_process(mode, tmp_path):
    out = tmp_path / "rank0.json"
    port = free_port()
    root = Path(__file__).resolve().parents[2]
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(r), "2", port, mode, str(out)], cwd=root,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    logs = [p.communicate(timeout=240)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(logs)[-4000:]
    got = json.loads(out.read_text())
    pre, post = reference()
    for n, v in pre.items():
        assert got["norms"][n] == pytest.approx(v, rel=1e-5), n
        assert got["post"][n] == pytest.approx(post[n], rel=1e-5), n
    assert got["sharded"] == (mode == "fsdp2")  # FSDP2 really handed the monitor DTensor shards
    assert got["logged"] == 1
    assert json.loads(Path(str(out) + ".1").read_text())["logged"] == 0  # only rank 0 logs
