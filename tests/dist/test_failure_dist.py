"""A failure on ONE rank during a distributed localization stops it on every rank together.

On 2 and 4 gloo processes (``failure_worker.py``), one rank raises an out-of-memory error at probe
k: in its loss_fn, inside the model's forward, after it, while copying the probe's gradient, or
while saving the gradients (or its loss_fn returns a float: ``ValueError`` on every rank, as for
inputs checked before any probe). Every rank raises ``LocateAborted`` naming that rank and its error,
returns within 60 s of the failure (the launch is bounded too: a hang fails the test), restores
its gradients bitwise, and training goes on: the next all_reduce pairs with the peers' and two
optimizer steps give exactly the parameters of a run without the localization. Through the
monitor, every rank warns and the step returns. One process: the same failure, the same state."""
from __future__ import annotations

import pytest
import torch

from . import failure_worker as F
from . import locate_worker as W
from .scenarios import FAILURE_MONITOR, failure_scenarios


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def failures(request, dist_results):
    world = request.param
    every = dist_results(world)
    return world, {s["name"]: (s, every[s["name"]][1]) for s in failure_scenarios(world)}


def expected_error(scn: dict) -> str:
    """The head of the message every rank must raise: the error type and where the search stopped."""
    rank, k = scn["fail_rank"], scn.get("fail_at", 1)
    where = scn.get("stops_at", {"snapshot": "saving the gradients", "copy": f"probe {k}, copying its gradient"}
                    .get(scn["where"], f"probe {k}, micro-batch 0"))
    if scn["where"] == "float":  # an input error found at a probe: ValueError, as before any probe
        return f"ValueError: {where}: rank {rank}: loss_fn(mask) returned float"
    return f"LocateAborted: localization aborted on every rank ({where}): "


def test_every_rank_raises_the_same_error_naming_the_failed_rank(failures):
    world, runs = failures
    for name, (scn, per_rank) in runs.items():
        first, rank = per_rank[0]["error"], scn["fail_rank"]
        assert first is not None and first.startswith(expected_error(scn)), (name, first)
        if scn["where"] != "float":
            assert f"rank {rank}: OutOfMemoryError: injected out of memory on rank {rank}" in first, (name, first)
        assert all(r["error"] == first for r in per_rank), name  # the same message everywhere
        for r, res in enumerate(per_rank):  # the original error is the failed rank's cause
            assert res["cause"] == ("OutOfMemoryError" if r == rank and scn["where"] != "float" else None), (name, r)


def test_every_rank_returns_within_60_s_of_the_failure(failures):
    world, runs = failures
    for name, (scn, per_rank) in runs.items():
        t_fail = per_rank[scn["fail_rank"]]["t_fail"]
        assert t_fail is not None, name
        late = max(r["t_return"] for r in per_rank) - t_fail
        assert 0 <= late < 60.0, (name, late)


def test_gradients_rng_and_modes_are_restored_on_every_rank(failures):
    world, runs = failures
    for name, (_, per_rank) in runs.items():
        for rank, res in enumerate(per_rank):
            assert res["grads_equal"] and res["rng_equal"] and res["modes_equal"], (name, rank)


def test_training_goes_on_in_step_and_unchanged(failures):
    """The next all_reduce sums every rank's value (no collective left unpaired), and FSDP2's root
    does not keep stale gathered parameters from the forward whose backward never ran."""
    world, runs = failures
    for name, (_, per_rank) in runs.items():
        for rank, res in enumerate(per_rank):
            assert res["all_reduce"] == world * (world + 1) / 2, (name, rank)
            assert res["params_equal"], (name, rank)


def test_the_monitor_warns_on_every_rank_and_the_step_returns(dist_results):
    (scn,) = FAILURE_MONITOR
    per_rank = dist_results(2)[scn["name"]][1]
    for rank, res in enumerate(per_rank):
        assert res["events"] == 1 and not res["located"], rank
        (warning,) = [w for w in res["warnings"] if "localizing the spike" in w]
        assert "LocateAborted" in warning and "rank 1: OutOfMemoryError" in warning, (rank, warning)
        assert res["all_reduce"] == 3.0, rank


def test_one_process_restores_the_same_state_and_raises_the_error():
    """The single-process reference: the failing loss_fn's own error propagates, gradients are
    restored bitwise and training goes on unchanged (the distributed path matches this)."""
    import gradloc_track

    scn = {"wrap": None, "culprits": [[0, 0, 3]], "fail_rank": 0, "fail_at": 3, "where": "loss", "method": "bisect"}
    model = W.build()
    x, y, w = W.global_batch(1, scn["culprits"])
    fn = W.make_loss_fn(model, x[0], y[0], w[0], W.B * W.T)
    mask = torch.ones(W.B, W.T)
    fn(mask).backward()
    before = [p.grad.clone() for p in model.parameters()]
    inj = F.Injector(scn, 0, model)
    with pytest.raises(torch.OutOfMemoryError, match="at probe 3"):
        gradloc_track.locate(model, inj.wrap(fn), mask, method="bisect")
    assert all(torch.equal(p.grad, b) for p, b in zip(model.parameters(), before))
    ref = W.build()
    ref_fn = W.make_loss_fn(ref, x[0], y[0], w[0], W.B * W.T)
    ref_fn(mask).backward()
    after, expected = F.train_on(model, [fn], [mask]), F.train_on(ref, [ref_fn], [mask])
    assert all(torch.equal(a, b) for a, b in zip(after, expected))
