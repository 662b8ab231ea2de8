"""locate() on 2 and 4 gloo processes (DDP, FSDP2) against a brute-force per-token oracle and
against single-process locate on the global batch. One process group per world size runs every
scenario (``scenarios.py``, ``locate_worker.py``); every launch is bounded, so a deadlock fails the test."""
from __future__ import annotations

import pytest
import torch

import gradloc_track
from gradloc_track.artifacts.identity import sample_fingerprint
from gradloc_track.grouping import layer_of

from . import locate_worker as W
from .scenarios import ERRORS, MONITOR, locate_scenarios


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def runs(request, dist_results):
    """(world, {name: scenario}, {name: per-rank results}, {name: per-rank results of the error
    and monitor scenarios}) from the world's shared launch (``conftest.dist_results``)."""
    world = request.param
    every = dist_results(world)
    scns = {s["name"]: s for s in locate_scenarios(world)}
    extra = {s["name"] for s in ERRORS + (MONITOR if world == 2 else [])}
    return world, scns, {n: every[n][1] for n in scns}, {n: every[n][1] for n in extra}


def _global_fns(model, world, scn):
    K = scn.get("micro", 1)
    x, y, w = W.global_batch(world, scn["culprits"], K)
    return [W.make_loss_fn(model, x[k], y[k], w[k], world * W.B * W.T) for k in range(K)], K


def oracle(world: int, scn: dict) -> dict:
    """Exact per-term gradient norms of the global-mean loss, one process, one backward per term."""
    model = W.build()
    fns, K = _global_fns(model, world, scn)
    out = {}
    for k in range(K):
        for gb in range(world * W.B):
            if gb // W.B in scn.get("empty", []):  # that rank has no loss terms
                continue
            for t in range(W.T):
                mask = torch.zeros(world * W.B, W.T)
                mask[gb, t] = 1.0
                model.zero_grad(set_to_none=True)
                fns[k](mask).backward()
                sq: dict[str, float] = {}
                for n, p in model.named_parameters():
                    sq[layer_of(n)] = sq.get(layer_of(n), 0.0) + float(p.grad.double().pow(2).sum())
                out[(gb // W.B, k, gb % W.B, t)] = (sum(sq.values()) ** 0.5, {n: v ** 0.5 for n, v in sq.items()})
    return out


def test_every_rank_returns_the_same_full_result(runs):
    world, _, results, _ = runs
    for name, per_rank in results.items():
        for r in range(1, world):  # ranks without a culprit return the full result too
            assert per_rank[r]["tokens"] == per_rank[0]["tokens"], (name, r)
            assert per_rank[r]["probes"] == per_rank[0]["probes"], (name, r)
            assert per_rank[r]["threshold"] == per_rank[0]["threshold"], (name, r)


def test_nothing_left_behind_on_any_rank(runs):
    world, scns, results, _ = runs
    for name, per_rank in results.items():
        for r, res in enumerate(per_rank):
            assert res["grads_equal"] and res["rng_equal"] and res["modes_equal"], (name, r, res)
            assert res["sharded"] == (scns[name]["wrap"] == "fsdp2"), name


def test_culprits_match_the_brute_force_oracle(runs):
    """Recall 1 and no false positive; exact norms and per-layer norms; probes <= m + 3 (auto)."""
    world, scns, results, _ = runs
    for name, per_rank in results.items():
        scn, res = scns[name], per_rank[0]
        exact = oracle(world, scn)
        tau = res["threshold"]
        expected = {t for t, (n, _) in exact.items() if n > tau}
        got = {(c[0], c[1] or 0, c[2], c[3]) for c in res["tokens"]}
        planted = {(c[0], c[1], c[2], c[3]) if len(c) == 4 else (c[0], 0, c[1], c[2]) for c in scn["culprits"]}
        assert expected == planted, (name, "the test's culprits must be the only terms above the threshold")
        if scn.get("method") == "gradloc":  # one path through the ranks: one rank's culprits
            assert got == expected and len({t[0] for t in expected}) == 1, name
        else:
            assert got == expected, (name, got, expected)
        assert not res["exhausted"], name
        for c in res["tokens"]:
            norm, layers = exact[(c[0], c[1] or 0, c[2], c[3])]
            assert c[4] == pytest.approx(norm, rel=1e-4), name
            assert c[5] == pytest.approx(layers, rel=1e-3, abs=1e-7), name
            assert (c[1] is None) == (scn.get("micro", 1) == 1), name
        if scn.get("method", "auto") == "auto":
            assert res["probes"] <= len(got) + 3, (name, res["probes"])
    if "ddp_explicit" in results:
        assert results["ddp_explicit"][0]["threshold"] == pytest.approx(20.0 / world)  # GradLoc's division


def test_bad_input_on_one_rank_raises_on_every_rank(runs):
    """Inputs are checked collectively before any probe: every rank raises the same error naming
    the rank at fault (no rank is left waiting in a collective), and gradients are untouched."""
    world, _, _, errors = runs
    for r, res in enumerate(errors["fsdp2_bad_rank1"]):
        assert res["error"] is not None and "rank 1: token_mask" in res["error"], (r, res)
        assert res["grads_equal"], r


def test_monitor_localizes_on_every_rank_and_rank0_writes(runs):
    """after_backward with a fixed-mode detector: every rank fires (the global token count), the
    collective search runs on all, and only rank 0's tracker gets the table, naming rank 1; the
    clipper (GlobalClip) scaled .grad first and the step check says the step is reproduced."""
    world, _, _, extra = runs
    if world != 2:
        pytest.skip("run on 2 processes")
    per_rank = extra["ddp_monitor"]
    assert all(r["events"] == 1 for r in per_rank), per_rank
    assert per_rank[0]["tokens"] == per_rank[1]["tokens"]
    assert [t[:4] for t in per_rank[0]["tokens"]] == [[1, None, 0, 3]]
    x, _, _ = W.global_batch(world, [[1, 0, 3]])
    (row,) = per_rank[0]["table"]
    assert (row["rank"], row["rank_sample"], row["position"], row["token_id"]) == (1, 0, 3, int(x[0, W.B, 3]))
    # the culprit's own sample columns and identity, gathered from rank 1 (strings included)
    assert (row["dataset_index"], row["source"]) == (W.B, "rank1-sample0")
    assert row["sample_id"] == sample_fingerprint(x[0, W.B].tolist())
    assert per_rank[0]["html"] == 1 and per_rank[1]["table"] == [] and per_rank[1]["html"] == 0
    for res in per_rank:  # clipped to half before localizing: the step check took the clip coefficient
        assert res["check"]["replayed"] and res["check"]["norm_ratio"] == pytest.approx(1.0, abs=1e-5), res["check"]
        assert not any("probes' sum" in n for n in res["notes"]), res["notes"]


def test_rank0_table_reads_token_ids_from_the_culprits_rank(runs):
    """Rank 0's attribution table names each culprit's rank, micro-batch and sample, with the
    token id that rank holds (sent as ids over the gather; rank 0 decodes them)."""
    world, scns, results, _ = runs
    for name, per_rank in results.items():
        scn = scns[name]
        x, _, _ = W.global_batch(world, scn["culprits"], scn.get("micro", 1))
        table = per_rank[0]["table"]
        assert len(table) == len(per_rank[0]["tokens"]), name
        for row in table:
            k = row.get("micro_batch") or 0
            assert row["token_id"] == int(x[k, row["rank"] * W.B + row["rank_sample"], row["position"]]), (name, row)
            assert row["token"] == f"<{row['token_id']}>"  # no tokenizer here: the id, decoded on rank 0
            # one story: the table's sample is the one on its rank, as the console names it
            assert row["sample"] == row["rank_sample"], (name, row)
        for r in range(1, world):
            assert per_rank[r]["table"] == [], name  # only rank 0 builds it


def test_equals_one_process_on_the_global_batch(runs):
    """Single-process locate on the concatenated batch with the global-mean loss finds the same
    culprits with the same norms, threshold and total norm."""
    world, scns, results, _ = runs
    for name in ("ddp_first_last", "fsdp2_first_last", "ddp_rank1"):
        scn, res = scns[name], results[name][0]
        model = W.build()
        fns, _ = _global_fns(model, world, scn)
        one = gradloc_track.locate(model, fns[0], torch.ones(world * W.B, W.T))
        assert [(c.batch // W.B, c.batch % W.B, c.position) for c in one.tokens] == \
               [(c[0], c[2], c[3]) for c in res["tokens"]], name
        for a, c in zip(one.tokens, res["tokens"]):
            assert c[4] == pytest.approx(a.grad_norm, rel=1e-4)
            assert c[6] == pytest.approx(a.share, rel=1e-3)  # shown (scaled alike when the culprits sum past 1)
            assert c[7] == (None if a.raw_share is None else pytest.approx(a.raw_share, rel=1e-3))  # exact
        assert res["threshold"] == pytest.approx(one.threshold, rel=1e-4)
        assert res["total_norm"] == pytest.approx(one.total_norm, rel=1e-4)


def test_global_loss_reference_is_the_ranks_average():
    """The oracle's premise: the global-mean loss's gradient is the average of the ranks' own-mean
    losses' gradients (what DDP/FSDP2 hand the optimizer)."""
    world, scn = 2, {"culprits": [[1, 0, 3]]}
    model = W.build()
    x, y, w = W.global_batch(world, scn["culprits"])
    W.make_loss_fn(model, x[0], y[0], w[0], world * W.B * W.T)(torch.ones(world * W.B, W.T)).backward()
    ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    for r in range(world):
        rows = slice(r * W.B, r * W.B + W.B)
        (W.make_loss_fn(model, x[0, rows], y[0, rows], w[0, rows], W.B * W.T)(torch.ones(W.B, W.T)) / world).backward()
    for a, b in zip(ref, (p.grad for p in model.parameters())):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
