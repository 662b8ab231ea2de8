"""verl's FSDP actor engine on 1, 2 and 4 gloo processes, a fixed rollout batch with one injected
response: the session (``integrations/verl/session.py``) names it (rank, micro-batch, sample; a
packed response as its document), identically on every rank, with RL columns equal to verl's own
tensors, gradients restored bitwise, the probes reproducing the step's gradient, verl's normaliser
on the step, and one MLflow run (verl's ``Tracking``) holding verl's metrics and ours.
One launch per world size (``conftest.verl_runs``, scenarios in ``scenarios.py``); each is
bounded (a hang fails)."""
from __future__ import annotations

from .requires import verl  # noqa: F401  (first: the module is skipped where verl is missing)

import html
import json
import math
import re

import pytest

from .engine_setup import B, R

STALE = [(2, "stale", 0), (2, "stale_seq-mean-token-sum", 1), (2, "stale_seq-mean-token-mean", 1), (4, "stale", 3)]


def _named(ranks: list, name: str) -> dict:
    """{(rank, micro_batch, response): share of the spike}: the responses the culprits name, each
    mapped by the rank that holds it (its own layout), summed over their culprit rows."""
    out: dict = {}
    for r, res in enumerate(ranks):
        for _level, k, response, share in res[name].get("mine", []):
            out[(r, k, response)] = out.get((r, k, response), 0.0) + share
    return out


def _where(scn_rank: int, row: int) -> tuple[int, int, int]:
    return scn_rank, row // 2, row % 2  # 2 rows per micro-batch, no dynamic batch sizes


def _top(ranks: list, name: str) -> tuple[int, int, int]:
    named = _named(ranks, name)
    assert named, ranks[0][name]
    return max(named, key=named.get)


@pytest.fixture(scope="module")
def world2(verl_runs):
    return verl_runs(2)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_every_rank_gets_the_same_answer_and_its_gradient_back(verl_runs, world):
    ranks, _ = verl_runs(world)
    for name, res in ranks[0].items():
        if name.startswith("_"):
            continue
        assert res["localized"] and res["events"] > 0, (name, res)
        for r, other in enumerate(ranks):
            assert other[name]["culprits"] == res["culprits"], (name, r)
            assert other[name]["probes"] == res["probes"], (name, r)
            assert other[name]["grads_equal"], (name, r)  # bitwise: the localizer left no trace
        if res["nonfinite"] is None:  # a NaN step has no finite replay to check (test_a_nan_advantage_...)
            assert res["step_check"][0] and res["step_check"][1] < 1e-5, (name, res["step_check"])


@pytest.mark.parametrize("world", [1, 2])
def test_a_reward_outlier_is_named(verl_runs, world):
    """Dr.GRPO advantages (mean-centred, no std): the outlier's +30 also gives its 3 group mates -10
    (they may be culprits too: verl's estimator moves them); the outlier carries the largest share.
    One process: FSDP2 on a 1-rank mesh (verl's single-GPU engine), DTensor gradients."""
    ranks, _ = verl_runs(world)
    where = _where(world - 1, 6)
    assert _top(ranks, "reward") == where
    if world == 2:  # named token by token: every token of it found
        assert len([1 for r_, m, s, *_ in ranks[0]["reward"]["tokens"] if (r_, m, s) == where]) == R


@pytest.mark.parametrize("world, name, rank", STALE)
def test_stale_old_logprobs_name_the_response_token_by_token(verl_runs, world, name, rank):
    """ratio ~e^2.2 on one response of 4 real tokens, advantage negative (the dual clip at 10 does
    not bind), under each loss aggregation and on 4 processes: its 4 tokens, nothing else, with
    the RL columns of verl's own tensors."""
    ranks, _ = verl_runs(world)
    res = ranks[0][name]
    where = _where(rank, 1)
    assert {(r_, m, s) for r_, m, s, *_ in res["tokens"]} == {where}
    assert len(res["tokens"]) == 4 and _top(ranks, name) == where
    rows = ranks[rank][name]["rows"]  # the culprit rank's own view of its rows
    assert len(rows) == 4
    for row in rows:
        for k in ("advantage", "old_logprob", "ref_logprob"):
            assert row["cols"][k] == row["verl"][k], (k, row)  # verl's own tensors, unchanged
        assert row["cols"]["ratio"] == pytest.approx(math.exp(row["cols"]["logprob"] - row["cols"]["old_logprob"]),
                                                     rel=1e-6)
        assert row["cols"]["ratio"] == pytest.approx(math.exp(2.2), rel=1e-3)
        assert row["cols"]["advantage"] < 0


@pytest.mark.parametrize("world, rank, row", [(1, 0, 5), (2, 1, 3)])
def test_a_packed_response_is_named_as_its_document(verl_runs, world, rank, row):
    """``use_remove_padding=True``: one packed row per micro-batch, each response a document of it
    (``document_ids``, carried across ranks); the culprits sit in that one row, and name the
    injected response through its document (a sample row's ``document``, a token's position)."""
    ranks, _ = verl_runs(world)
    res = ranks[0]["packed"]
    assert res["documents"]
    assert _top(ranks, "packed") == _where(rank, row)
    rows = [c for c in res["culprits"] if c[0] != "micro_batch"]
    assert rows and all(c[3] == 0 for c in rows)  # the one packed row of its micro-batch
    samples = [c for c in rows if c[0] == "sample"]
    assert all(c[4] is not None for c in samples)
    if world == 1:  # named as a whole document: the injected one first
        assert samples[0][2:5] == [row // 2, 0, row % 2]


def test_the_step_carries_verls_normaliser(world2):
    ranks, _ = world2
    tokens = 2 * (B * R - 2)  # B rows of R tokens per rank, one response 2 shorter
    assert ranks[0]["stale"]["normaliser"] == tokens  # token-mean: batch_num_tokens, global
    assert ranks[0]["stale_seq-mean-token-sum"]["normaliser"] == 2 * B  # global_batch_size
    assert ranks[0]["stale_seq-mean-token-mean"]["normaliser"] is None  # per-row means: no one number


def test_the_spike_block_names_the_response(world2):
    ranks, _ = world2
    block = ranks[0]["stale"]["block"]
    assert "── spike at step" in block and "response" in block
    # through the shared console: the response by its group and reward, where it lives (rank 0's gathered view)
    assert re.search(r"response \d+ of group \S+, reward \S+ \(rank 0, micro-batch 0, sample 1\)", block), block
    assert "MLflow run" in block and ranks[0]["_run_id"] in block  # its link: the run verl's Tracking opened


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


def test_the_run_dir_leads_report_and_culprits_to_verls_run(world2, tmp_path):
    """The joined run is recorded like every front door's (``trackers.join``): ``gradloc-track report``
    and ``culprits`` follow ``gradloc.run_dir`` to verl's MLflow run and its spike."""
    from gradloc_track.cli import main

    ranks, out = world2
    record = json.loads((out / "run" / "tracker" / "mlflow.json").read_text())
    assert record["spec"]["joined"] is True and record["view"]["run_id"] == ranks[0]["_run_id"]
    assert main(["report", str(out / "run"), "-o", str(tmp_path / "report.html")]) == 0
    assert main(["culprits", str(out / "run"), "-o", str(tmp_path / "ledger")]) == 0
    (sample,) = json.loads((tmp_path / "ledger" / "culprits.json").read_text())["samples"]
    stale = ranks[0]["stale"]["rows"][0]  # rank 0 holds it: its group (verl's uid) and place
    assert (sample["group"], sample["index"], sample["rank_sample"]) == (stale["uid"], 1, 1)
    assert sample["max_share"] > .5
    page = (tmp_path / "report.html").read_text()  # the culprit table: its group and each of its tokens
    assert stale["uid"] in page and all(f"<td class='tok'>{html.escape(c)}</td>" in page for c in sample["text"])


NAN = [(1, "nan", 0, 2), (2, "nan", 1, 2), (2, "nan_packed", 1, 5), (4, "nan", 3, 2)]


@pytest.mark.parametrize("world, name, rank, row", NAN)
def test_a_nan_advantage_on_one_rank_is_named_on_every_rank(verl_runs, world, name, rank, row):
    """A reward that came back NaN for one response: the step's gradient is NaN on every rank; the
    non-finite search (across ranks) names that response on its rank, micro-batch and tokens, the
    same on every rank, and verl skips the update on every rank. (A probe zeroes verl's tensors
    where its mask is cut, so the other responses' probes are finite: ``layout.narrowed``.)"""
    ranks, _ = verl_runs(world)
    res = ranks[0][name]
    on = f"rank {rank}, " if world > 1 else ""  # one process (FSDP2 on a 1-rank mesh): no rank to name
    assert res["localized"] and f"{on}micro-batch {row // 2}, sample " in res["nonfinite"], res
    assert "'s gradient is NaN (tokens " in res["nonfinite"], res["nonfinite"]  # token by token
    assert len([c for c in res["culprits"] if c[0] == "token"]) == R  # every token of the response, no other
    for r, other in enumerate(ranks):
        assert other[name]["culprits"] == res["culprits"] and other[name]["nonfinite"] == res["nonfinite"], r
        assert other[name]["grads_equal"] and other[name]["stepped"] is False, (r, other[name]["stepped"])
    assert {(rank, k, response) for _, k, response, _ in ranks[rank][name]["mine"]} == {(rank, row // 2, row % 2)}
    assert all(c[1] == (rank if world > 1 else None) for c in res["culprits"])
    table = ranks[0][name]["table"]
    assert table and all(t["nonfinite"] and t.get("rank") == (rank if world > 1 else None) for t in table), table
    assert re.search(rf"non-finite (document \d+ \()?{on}micro-batch", res["block"]), res["block"]


def _console_places(block: str) -> set:
    return {tuple(int(x) for x in m) for m in re.findall(r"\(rank (\d+), micro-batch (\d+), sample (\d+)", block)}


@pytest.mark.parametrize("world", [2, 4])
def test_the_table_names_the_sample_the_console_names(verl_runs, world):
    """One story on every rank count: the table's rank, micro-batch and sample are the console's
    (the sample is the one in its rank's batch, not the gathered view's row)."""
    ranks, _ = verl_runs(world)
    for name, res in ranks[0].items():
        if name.startswith("_") or not res.get("table"):
            continue
        rows = {(t["rank"], t["micro_batch"], t["sample"]) for t in res["table"] if t["level"] != "micro_batch"}
        assert rows == _console_places(res["block"]), (name, rows, res["block"])


@pytest.mark.parametrize("world", [1, 2, 4])
def test_the_highlight_page_keeps_prompt_and_response_on_any_rank_count(verl_runs, world):
    ranks, _ = verl_runs(world)
    pages = {name: res["page_parts"] for name, res in ranks[0].items() if not name.startswith("_") and
             "page_parts" in res}
    assert pages and all(parts == ["prompt", "response"] for parts in pages.values()), pages


@pytest.mark.parametrize("name", ["packed", "nan_packed"])
def test_packed_lines_carry_rank_reward_group_and_index(world2, name):
    """A packed micro-batch is one row; its responses are documents: each culprit line and table row
    still says its response's index, group, reward and rank, and its document."""
    ranks, _ = world2
    res = ranks[0][name]
    lines = [x for x in res["block"].splitlines() if " of group " in x]
    assert lines and all(re.search(r"response \d of group s\d+r1p\d, reward \S+ \(rank 1, micro-batch \d, "
                                   r"sample 0, document \d\)", x) for x in lines), res["block"]
    for t in res["table"]:
        if t["level"] != "micro_batch":
            assert t["group"].startswith("s") and t["index"] in range(4) and t["reward"] is not None, t
            assert t["rank"] == 1 and t["document"] is not None, t
