"""A NaN on one rank, named on every rank: the non-finite search under torch.distributed.

On 2 and 4 gloo processes (``nonfinite_worker.py``; each launch bounded, a hang fails), NaN loss
weights on one rank (or two) make the step's gradient NaN. Every rank must return the same
finding: the sample with its rank, micro-batch and tokens, exactly the rows one process names on
the global batch (its row ``r * B + b`` is rank ``r``'s sample ``b``), gradients and RNG as they
were. Through the monitor the NaN step is detected, localized, written to rank 0's table with
its rank, and skipped by the optimizer on every rank.
"""
from __future__ import annotations

import pytest
import torch

from gradloc_track import locate

from . import locate_worker as W
from . import nonfinite_worker as N
from .scenarios import NONFINITE_MONITOR, nonfinite_scenarios


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def nonfinite_runs(request, dist_results):
    world = request.param
    every = dist_results(world)
    return world, {s["name"]: (s, every[s["name"]][1]) for s in nonfinite_scenarios(world)}


def one_process_rows(scn: dict, world: int) -> tuple[str, list]:
    """(where, rows) of single-process locate on the global batch, rows placed as (rank, own sample)."""
    model = W.build()
    K = scn.get("micro", 1)
    x, y, w = N.global_batch(scn, world)
    fns = [N.loss_of(model, x[k], y[k], w[k], world * W.B * W.T, scn["loss"]) for k in range(K)]
    masks = [torch.ones(world * W.B, W.T) for _ in range(K)]
    for fn, m in zip(fns, masks):
        fn(m).backward()
    res = locate(model, fns if K > 1 else fns[0], masks if K > 1 else masks[0])
    rows = []
    for c in res.culprits:
        level, _, mb, row, start, end, nf = N.rows_of(c)
        rows.append([level, row // W.B, mb, row % W.B, start, end, nf])
    return res.nonfinite.where, rows


def test_every_rank_names_the_same_nan_sample_as_one_process(nonfinite_runs):
    world, runs = nonfinite_runs
    for name, (scn, per_rank) in runs.items():
        first = per_rank[0]
        assert all(r["rows"] == first["rows"] and r["detail"] == first["detail"] for r in per_rank), name
        if scn["loss"] == "nomap":
            continue  # test_without_a_map_the_rank_whose_forward_is_nan_is_named
        where, rows = one_process_rows(scn, world)
        assert first["where"] == where and sorted(first["rows"]) == sorted(rows), (name, first, rows)
        cells = {(r, b, t) for _, r, b, t in scn["nan"]}  # every injected cell is named, on its rank
        named = {(rank, b, start) for level, rank, _, b, start, _, _ in first["rows"] if level == "token"}
        assert cells <= named, (name, first["rows"])
        for _, r, b, _ in scn["nan"]:
            assert f"rank {r}, " in first["detail"] and f"sample {b}" in first["detail"], (name, first["detail"])


def test_without_a_map_the_rank_whose_forward_is_nan_is_named(nonfinite_runs):
    """Every probe of the micro-batch is NaN and the mask has no gradient: one process can say no
    more than that; distributed, the rank and micro-batch whose own forward's loss is NaN are named."""
    world, runs = nonfinite_runs
    for name, (scn, per_rank) in runs.items():
        if scn["loss"] != "nomap":
            continue
        (k, r, _, _), first = scn["nan"][0], per_rank[0]
        assert first["where"] == one_process_rows(scn, world)[0] == "all", (name, first)
        assert first["rows"] == [["micro_batch", r, k, None, None, None, True]], first["rows"]
        assert f"rank {r}, micro-batch {k}: its own forward's loss is NaN" in first["detail"], first["detail"]


def test_the_search_restores_every_rank(nonfinite_runs):
    _, runs = nonfinite_runs
    for name, (_, per_rank) in runs.items():
        assert all(r["grads_equal"] and r["rng_equal"] for r in per_rank), name


def test_a_safe_loss_is_searched_by_halving_over_every_ranks_samples(nonfinite_runs):
    """``torch.where`` masking: no term-loss map, so the sample is found by isfinite halving across
    ranks (more probes than the micro-batch scans) and no sentence says every probe is NaN."""
    world, runs = nonfinite_runs
    for name, (scn, per_rank) in runs.items():
        if scn["loss"] == "safe":
            assert per_rank[0]["probes"] > 1 + scn.get("micro", 1) and "whatever the mask" not in \
                per_rank[0]["detail"], (name, per_rank[0])


def test_the_monitor_localizes_the_nan_step_and_every_rank_skips_it(dist_results):
    (scn,) = NONFINITE_MONITOR
    per_rank = dist_results(2)[scn["name"]][1]
    first = per_rank[0]
    assert all(r["events"] >= 1 and r["skipped"] and not r["warnings"] for r in per_rank), per_rank
    assert all(r["rows"] == first["rows"] and r["detail"] == first["detail"] for r in per_rank)
    assert ["token", 1, None, 0, 3, 4, True] in first["rows"], first["rows"]
    row = next(r for r in first["table"] if r["level"] == "token")
    assert (row["rank"], row["rank_sample"], row["position"], row["nonfinite"]) == (1, 0, 3, True), row
