"""HSDP-style 2x2 mesh (replicate x shard) on 4 gloo processes: per-tensor norms are summed over
the shard dim only, so they equal the single-process norms, and AdaGC's per-tensor thresholds
are identical on every replica."""
from __future__ import annotations

import json
import math

import pytest

from tests.monitor import dist_worker as base

from . import hsdp_worker
from .launch import fork_ranks


def reference():
    """One process, full batch, plain per-parameter loop; AdaGC step 1 thresholds by hand."""
    model = base.build()
    base.loss_of(model, base.global_batch()).backward()
    norms = {n: p.grad.double().norm().item() for n, p in model.named_parameters()}
    total = math.sqrt(sum(v * v for v in norms.values()))
    coef = min(1.0, 0.5 / (total + 1e-6))  # warm-up step: global clip at lambda_abs=0.5
    gamma = {n: v * coef for n, v in norms.items()}  # running min of post-clip norms (one step)
    return norms, {n: 1.04 * g for n, g in gamma.items()}


def test_hsdp_norms_and_adagc_thresholds(tmp_path):
    fork_ranks(hsdp_worker.main, 4, (str(tmp_path),), timeout=240)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert ranks[0]["placements"] == ["(Replicate(), Shard(dim=0))"]  # really HSDP
    norms, thresholds = reference()
    for res in ranks:
        for step in res["steps"]:
            for n, v in norms.items():
                assert step["norms"][n] == pytest.approx(v, rel=1e-5, abs=1e-9), n
        got = dict(zip(res["names"], res["steps"][1]["thresholds"]))
        for n, v in thresholds.items():
            assert got[n] == pytest.approx(v, rel=1e-5), n
        assert res["collectives"] == 2  # ONE all-reduce per step (over the shard dim)
    for res in ranks[1:]:  # identical, not merely close: replicas must clip alike
        assert res["steps"][1]["thresholds"] == ranks[0]["steps"][1]["thresholds"]
        assert res["steps"][1]["gamma"] == ranks[0]["steps"][1]["gamma"]
