"""2 processes on gloo: DDP and FSDP2 (DTensor) gradients give the single-process norms."""
from __future__ import annotations

import json
import math
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from gradloc_track.grouping import layer_of

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
    layers: dict[str, list[float]] = {}
    for n, p in model.named_parameters():
        g, w = layers.setdefault(layer_of(n), [0.0, 0.0]), p.detach().double().norm().item()
        g[0] += pre[n] ** 2
        g[1] += w * w
    return pre, {n: v * coef for n, v in pre.items()}, {k: (math.sqrt(g), math.sqrt(w)) for k, (g, w) in layers.items()}


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_two_process_norms_match_single_process(mode, tmp_path):
    out = tmp_path / "rank0.json"
    port = free_port()
    root = Path(__file__).resolve().parents[2]
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(r), "2", port, mode, str(out)], cwd=root,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    logs = [p.communicate(timeout=240)[0] for p in procs]
    report = "\n".join(f"--- rank {r} exited {p.returncode} ---\n{log[-2000:]}"
                       for r, (p, log) in enumerate(zip(procs, logs)))
    assert all(p.returncode == 0 for p in procs), report
    got = json.loads(out.read_text())
    pre, post, layers = reference()
    m = got["metrics"]
    for n, v in pre.items():
        assert got["norms"][n] == pytest.approx(v, rel=1e-5), n
        assert m[f"grad_norm/tensor/{n}"] == pytest.approx(v, rel=1e-5), n
        assert got["post"][n] == pytest.approx(post[n], rel=1e-5), n
    for lay, (g, w) in layers.items():
        assert got["layers"][lay] == pytest.approx(g, rel=1e-5), lay
        assert m[f"grad_norm/{lay}"] == pytest.approx(g, rel=1e-5), lay
        assert m[f"weight_norm/{lay}"] == pytest.approx(w, rel=1e-5), lay
    assert got["sharded"] == (mode == "fsdp2")  # FSDP2 really handed the monitor DTensor shards
    # DDP grads are already averaged: no collective; FSDP2: ONE all-reduce for grads + weights
    assert got["collectives"] == (1 if mode == "fsdp2" else 0)
    assert got["logged"] == 1
    assert json.loads(Path(str(out) + ".1").read_text())["logged"] == 0  # only rank 0 logs
