"""verl's FSDP actor engine on 1, 2 and 4 gloo processes, a fixed rollout batch with one injected
response: the session (``integrations/verl/session.py``) names it, identically on every rank, with
RL columns equal to verl's own tensors, gradients restored bitwise, the probes reproducing the
step's gradient, and one MLflow run (verl's ``Tracking``) holding verl's metrics and ours.
One launch per world size (``conftest.verl_runs``); each is bounded (a hang fails)."""
from __future__ import annotations

import math

import pytest

from .engine_setup import R


def _samples(res: dict) -> dict:
    """{(rank, micro_batch, sample): summed squared norm of its culprit tokens}."""
    out: dict = {}
    for rank, mb, b, _pos, norm in res["tokens"]:
        out[(rank, mb, b)] = out.get((rank, mb, b), 0.0) + norm ** 2
    return out


def _where(scn_rank: int, row: int) -> tuple[int, int, int]:
    return scn_rank, row // 2, row % 2  # 2 rows per micro-batch, no dynamic batch sizes


@pytest.fixture(scope="module")
def world2(verl_runs):
    return verl_runs(2)


def test_every_rank_gets_the_same_answer_and_its_gradient_back(world2):
    ranks, _ = world2
    for name, res in ranks[0].items():
        if name.startswith("_"):
            continue
        for r, other in enumerate(ranks):
            assert other[name]["tokens"] == res["tokens"], (name, r)
            assert other[name]["probes"] == res["probes"], (name, r)
            assert other[name]["grads_equal"], (name, r)  # bitwise: the localizer left no trace
        assert res["step_check"][0] and res["step_check"][1] < 1e-5, (name, res["step_check"])


@pytest.mark.parametrize("name", ["reward", "reward_seq-mean-token-sum", "reward_seq-mean-token-mean"])
def test_a_reward_outlier_is_named_under_every_loss_aggregation(world2, name):
    """Dr.GRPO advantages (mean-centred, no std): the outlier's +30 also gives its 3 group mates -10
    (they may be culprits too: verl's estimator moves them); the outlier carries the largest share,
    every token of it found."""
    ranks, _ = world2
    res = ranks[0][name]
    assert res["localized"] and res["events"] > 0, res
    rank, mb, b = _where(1, 4 if name != "reward" else 6)
    shares = _samples(res)
    assert max(shares, key=shares.get) == (rank, mb, b), shares
    assert len([1 for r_, m, s, *_ in res["tokens"] if (r_, m, s) == (rank, mb, b)]) == R  # all its tokens


def test_stale_old_logprobs_name_the_response_token_by_token(world2):
    """ratio ~e^2.2 on one response of 4 real tokens, advantage negative (the dual clip at 10 does not bind)."""
    ranks, _ = world2
    res = ranks[0]["stale"]
    rank, mb, b = _where(0, 1)
    assert {(r_, m, s) for r_, m, s, *_ in res["tokens"]} == {(rank, mb, b)}
    assert len(res["tokens"]) == 4  # every real token of that response, nothing else
    rows = ranks[rank]["stale"]["rows"]  # the culprit rank's own view of its rows
    assert len(rows) == 4
    for row in rows:
        for k in ("advantage", "old_logprob", "ref_logprob"):
            assert row["cols"][k] == row["verl"][k], (k, row)  # verl's own tensors, unchanged
        assert row["cols"]["ratio"] == pytest.approx(math.exp(row["cols"]["logprob"] - row["cols"]["old_logprob"]),
                                                     rel=1e-6)
        assert row["cols"]["ratio"] == pytest.approx(math.exp(2.2), rel=1e-3)
        assert row["cols"]["advantage"] < 0


def test_the_spike_block_names_the_response(world2):
    ranks, _ = world2
    block = ranks[0]["stale"]["block"]
    assert "── spike at step" in block and "response" in block
    assert "rank 0, micro-batch 0, sample 1" in block, block


def test_one_mlflow_run_holds_verls_metrics_and_ours(world2):
    from mlflow.tracking import MlflowClient

    ranks, out = world2
    client = MlflowClient(f"sqlite:///{out}/mlflow.db")
    run = client.get_run(ranks[0]["_run_id"])
    keys = set(run.data.metrics)
    assert {"actor/pg_loss", "actor/grad_norm", "actor/ppo_kl"} <= keys  # verl's
    assert {"actor/grad_norm/global", "actor/grad_norm/model.layers.0", "actor/spike/detected",
            "actor/locate/probes"} <= keys  # ours, through verl's Tracking
    runs = client.search_runs([run.info.experiment_id])
    assert len(runs) == 1  # no second run
    arts = [a.path for a in client.list_artifacts(run.info.run_id, "spikes")]
    assert any("tokens" in a for a in arts) and any("highlight" in a for a in arts), arts


def test_four_processes(verl_runs):
    ranks, _ = verl_runs(4)
    res = ranks[0]["reward"]
    assert res["localized"], res
    shares = _samples(res)
    assert max(shares, key=shares.get) == _where(3, 6)
    for other in ranks[1:]:
        assert other["reward"]["tokens"] == res["tokens"] and other["reward"]["grads_equal"]


@pytest.mark.xfail(strict=True, reason="localizer: one process with FSDP2 (verl's single-GPU engine) gives DTensor "
                   "gradients the single-process path does not take (step_check, grouping); request in the report")
def test_one_process(verl_runs):
    ranks, _ = verl_runs(1)
    assert ranks[0]["reward"]["localized"], ranks[0]["reward"]["not_localized"]
