"""Every level across processes (issue 27 item 2, issue 30 item 3): the single-process level
scenarios (a bad sample, a span, a packed document named by ``document_ids``, a micro-batch of one
sample repeated, culprits in two micro-batches, nothing standing out) on one global batch, under
one process and under 2 and 4 gloo processes (DDP and FSDP2), give the same rows: level, the piece
(rank, micro-batch) and sample that hold them, document, span, gradient norm and share. Every rank
gets the same answer and leaves no trace; rank 0's table names the rank and document of each row.
The runs share the world's one launch (``conftest.dist_results``), which is bounded: a deadlock fails."""
from __future__ import annotations

import functools

import pytest

from . import levels_case as L
from .scenarios import levels_scenarios


@functools.lru_cache(maxsize=None)
def reference(case: str) -> dict:
    return L.one_process(case)


@pytest.fixture(scope="module", params=[2, 4], ids=["world2", "world4"])
def levels(request, dist_results):
    world = request.param
    every = dist_results(world)
    return world, {s["name"]: (s, every[s["name"]][1]) for s in levels_scenarios(world) if "fail_rank" not in s}


def same_rows(got: dict, want: dict, what: str) -> None:
    assert set(got) == set(want), (what, sorted(got), sorted(want))
    for key, (norm, share) in want.items():
        g_norm, g_share = got[key]
        assert g_norm == pytest.approx(norm, rel=1e-4), (what, key)
        assert g_share == pytest.approx(share, rel=1e-3, abs=1e-6), (what, key)


def test_every_level_equals_one_process_on_the_global_batch(levels):
    world, runs = levels
    for name, (scn, per_rank) in runs.items():
        want, got = reference(scn["case"]), per_rank[0]
        same_rows(got["culprits"], want["culprits"], name)
        assert got["threshold"] == pytest.approx(want["threshold"], rel=1e-4), name
        assert got["total_norm"] == pytest.approx(want["total_norm"], rel=1e-5), name
        assert set(got["shares"]) == set(want["shares"]), name
        if scn["case"] in ("flagged", "flagged_alone"):  # named by the rank that holds each flagged row
            (note,) = [n for n in got["notes"] if "named for a test's data signal" in n]
            assert note.count("rank ") == 2, (name, note)
        for key, share in want["shares"].items():
            assert got["shares"][key] == pytest.approx(share, rel=1e-3, abs=1e-6), (name, key)


def test_the_planted_cause_is_named_at_its_level():
    """The one-process answers the distributed ones are held to (rows keyed level|piece|sample|document|start|end)."""
    levels = {case: {k.split("|")[0] for k in reference(case)["culprits"]} for case in L.CASES}
    assert "sample|2|1|None|0|16" in reference("bad_sample")["culprits"]
    assert "span|1|0|None|5|10" in reference("span")["culprits"]
    assert f"sample|{L.DOC_ROW[0]}|{L.DOC_ROW[1]}|1|5|11" in reference("document")["culprits"]
    assert set(reference("micro_batch")["culprits"]) == {"micro_batch|1|None|None|None|None"}
    two = reference("two_micro_batches")["culprits"]
    assert "token|0|2|None|7|8" in two and "sample|3|0|None|0|16" in two
    assert levels["nothing"] == set() and len(reference("nothing")["shares"]) == L.G * L.B
    assert set(reference("hot_tokens")["culprits"]) == {"token|2|1|None|3|4", "token|2|1|None|9|10"}
    assert set(reference("flagged")["culprits"]) == {"sample|2|1|None|0|16", "span|1|0|None|5|10"}
    assert set(reference("flagged_alone")["culprits"]) == {"sample|2|1|None|0|16", "span|1|0|None|5|10"}
    assert all(reference(case)["replayed"] for case in L.CASES)


def test_identical_on_every_rank_and_nothing_left_behind(levels):
    world, runs = levels
    for name, (_, per_rank) in runs.items():
        for r, res in enumerate(per_rank):
            assert res["culprits"] == per_rank[0]["culprits"] and res["shares"] == per_rank[0]["shares"], (name, r)
            assert res["probes"] == per_rank[0]["probes"], (name, r)
            assert res["restored"] and res["replayed"], (name, r)


def test_rank0_table_names_the_rank_and_document_of_every_row(levels):
    world, runs = levels
    k = L.G // world
    for name, (scn, per_rank) in runs.items():
        table = per_rank[0]["table"]
        assert len(table) == len(per_rank[0]["culprits"]), name
        for row in table:
            assert row["rank"] is not None, (name, row)
        if scn["case"] == "document":
            (doc,) = [r for r in table if r["level"] == "sample"]
            rank, mb = divmod(L.DOC_ROW[0], k)
            assert (doc["rank"], doc["rank_sample"], doc["document"]) == (rank, L.DOC_ROW[1], 1), doc
            assert (doc["micro_batch"] if k > 1 else 0) == mb
        for r in range(1, world):
            assert per_rank[r]["table"] == [], name


@pytest.mark.parametrize("world", [2, 4])
def test_a_failure_in_a_levels_probe_stops_every_rank_together(dist_results, world):
    """Rank 0's loss_fn raises in the bad sample's confirmation probe (probe 2): every rank raises
    ``LocateAborted`` naming it, restored (FSDP2)."""
    (scn,) = [s for s in levels_scenarios(world) if "fail_rank" in s]
    per_rank = dist_results(world)[scn["name"]][1]
    for r, res in enumerate(per_rank):
        assert res["error"] is not None and res["error"].startswith(
            "LocateAborted: localization aborted on every rank (probe 2, micro-batch 0): rank 0: OutOfMemoryError"), \
            (r, res["error"])
        assert res["error"] == per_rank[0]["error"] and res["restored"], r
