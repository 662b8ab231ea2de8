"""AdaGC on 2 gloo processes with FSDP2: mode="tensor" equals one process; mode="shard" clips each
local shard by the official rule on its own norms, with no collective after warm-up."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from . import dist_adagc_worker as worker


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def single_process_post_norms():
    from gradloc_track.clip import AdaGC

    model = worker.build()
    clipper = AdaGC(model, warmup_steps=1, lambda_abs=0.5, beta=0.9)
    out = []
    for step in range(worker.STEPS):
        model.zero_grad(set_to_none=True)
        b = worker.batch(step)
        # the ranks' mean losses, averaged by FSDP: the same gradient as the two halves' mean
        sum(worker.loss_of(model, half) for half in b.chunk(2)).div(2).backward()
        clipper.clip()
        out.append([p.grad.double().norm().item() for p in model.parameters()])
    return out


def test_fsdp2_tensor_mode_equals_one_process_and_shard_mode_needs_no_collective(tmp_path):
    out = tmp_path / "result"
    port = free_port()
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}  # this checkout
    procs = [subprocess.Popen([sys.executable, str(Path(worker.__file__)), str(r), "2", port, str(out)], cwd=root,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    try:
        logs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()  # a deadlock fails the test instead of hanging it
    report = "\n".join(f"--- rank {r} exited {p.returncode} ---\n{log[-2000:]}"
                       for r, (p, log) in enumerate(zip(procs, logs)))
    assert all(p.returncode == 0 for p in procs), report
    ranks = [json.loads((tmp_path / f"result.{r}").read_text()) for r in range(2)]
    ref = single_process_post_norms()
    for step, norms in enumerate(ref):
        for got, want in zip(ranks[0]["tensor_post"][step], norms):
            assert got == pytest.approx(want, rel=1e-4, abs=1e-9), step
    total0 = sum(v * v for r in ranks for v in r["shard_pre"][0]) ** 0.5  # FSDP2 shards partition the tensors
    for r in ranks:
        want = [min(1.0, 0.5 / (total0 + 1e-6))] * len(r["shard_coefs"][0])
        assert r["shard_coefs"][0] == pytest.approx(want, rel=1e-5)
        assert r["shard_collectives"] == [1] + [0] * (worker.STEPS - 1)  # warm-up's global norm only
        for step in range(1, worker.STEPS):  # the official rule on this rank's own shard norms
            for i, c in enumerate(r["shard_coefs"][step]):
                assert c == pytest.approx(_coef_after_warmup(r, step, i), rel=1e-5), (step, i)
        assert any(c < 1 for step in r["shard_coefs"][1:] for c in step)  # the stream exercised clipping


def _coef_after_warmup(r, step, i):
    """The official shard rule for tensor ``i`` at ``step`` from this rank's own shard norms:
    warm-up (step 0) global clip at 0.5 of the GLOBAL norm sets gamma = post-clip shard norm."""
    pre = r["shard_pre"]
    warm_coef = r["shard_coefs"][0][i]
    gamma = pre[0][i] * warm_coef
    for t in range(1, step + 1):
        n = pre[t][i]
        thr = 1.04 * gamma
        c, eff = (thr / (n + 1e-6), thr) if n > thr else (1.0, n)
        gamma = 0.9 * gamma + 0.1 * eff
        if t == step:
            return c
    raise AssertionError
