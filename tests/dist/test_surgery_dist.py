"""Spike surgery on 2 gloo processes (DDP, and FSDP2's sharded gradients): every rank's optimizer
gets the step's gradient minus the culprits' (a plain single-process backward of their terms,
averaged over ranks as DDP averages), then clipped; within 1e-6 relative, no hang (a timeout),
the same on both ranks."""
from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from . import surgery_worker as W
from .launch import fork_ranks

WORLD = 2
SCENARIOS = [{"name": "one_micro_batch", "micro": 1}, {"name": "accumulation", "micro": 2},
             {"name": "fsdp2_accumulation", "micro": 2, "wrap": "fsdp2"}]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("surgery_dist")
    fork_ranks(W.main, WORLD, (str(out), json.dumps(SCENARIOS)), timeout=240)
    return {s["name"]: [torch.load(out / f"{s['name']}.rank{r}.pt", weights_only=False) for r in range(WORLD)]
            for s in SCENARIOS}


def norm(g) -> float:
    return math.sqrt(sum(float(x.double().pow(2).sum()) for x in g))


def culprits_gradient(got: list[dict], n_micro: int) -> list[torch.Tensor]:
    """(1/W) sum over ranks of the gradient of each rank's culprit terms, one plain backward each,
    on a model holding the spike step's weights (no DDP)."""
    model = W.build()
    model.load_state_dict(got[0]["weights"])
    params = list(model.parameters())
    total = [torch.zeros_like(p) for p in params]
    for r, rank_out in enumerate(got):
        for k, (x, y, w) in enumerate(rank_out["batches"]):
            mask = torch.zeros(W.B, W.T)
            for cr, ck, b, t in got[0]["culprits"]:
                if (cr, ck) == (r, k):
                    mask[b, t] = 1.0
            if not mask.any():
                continue
            per = F.cross_entropy(model(x).reshape(-1, W.V), y.reshape(-1), reduction="none").view(W.B, W.T)
            loss = (per * w * mask).sum() / (W.B * W.T * n_micro)
            for acc, g in zip(total, torch.autograd.grad(loss, params, allow_unused=True)):
                if g is not None:
                    acc += g / WORLD  # DDP averages over the ranks
    return total


@pytest.mark.parametrize("scn", SCENARIOS, ids=[s["name"] for s in SCENARIOS])
def test_every_rank_steps_on_the_gradient_minus_the_culprits(runs, scn):
    got = runs[scn["name"]]
    K = scn["micro"]
    assert got[0]["events"] and got[0]["culprits"] == got[1]["culprits"] == [(1, K - 1, W.CULPRIT[1], W.CULPRIT[2])]
    cut = culprits_gradient(got, K)
    own = got[0]["own"]  # the step's gradient, as DDP left it (the same on both ranks)
    assert all(torch.equal(a, b) for a, b in zip(own, got[1]["own"]))
    operated = [g - c for g, c in zip(own, cut)]
    coef = min(1.0, W.MAX_NORM / (norm(operated) + 1e-6))  # clip_grad_norm_ by hand (the full gradient)
    assert coef < 1.0  # the clipper scaled the operated gradient
    want = [x * coef for x in operated]
    for r in range(WORLD):
        received = got[r]["received"]
        assert norm([a - b for a, b in zip(received, want)]) / norm(want) < 1e-6, r
        op = got[r]["surgery"]
        assert op["applied"] and op["scale"] == 1.0
        assert op["grad_norm_post"] == pytest.approx(norm(operated), rel=1e-5)
    share = sum(float((c.double() * g.double()).sum()) for c, g in zip(cut, own)) / norm(own) ** 2
    logged = got[0]["metrics"]  # rank 0 logs
    assert logged["surgery/removed_share"] == pytest.approx(share, rel=1e-5) and 0.3 < share < 0.99
    assert logged["clip/total_norm_pre"] == pytest.approx(norm(operated), rel=1e-5)
