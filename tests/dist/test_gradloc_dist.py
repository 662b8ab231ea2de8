"""Distributed ``method="gradloc"`` is GradLoc's own path on 2, 3 and 4 gloo processes with
unequal token counts: the same hits, probe count and probed masks as the port of the official
micro-batch stage -> rank search -> token bisection (``gradloc_port.py``), run in one process."""
from __future__ import annotations

import pytest

from .gradloc_port import Reference
from .scenarios import port_cases


def compare(case: dict, per_rank: list[dict], world: int, ref: dict | None = None) -> list[str]:
    """What differs between the distributed run and the reference (empty: nothing)."""
    ref = ref or Reference(case, world).run(case["T"], case["budget"])
    assert ref["margin"] > 1e-4, f"{case['name']}: a decision sits {ref['margin']:.1e} from its threshold"
    got = per_rank[0]
    diffs = []
    if {tuple(h) for h in got["hits"]} != ref["hits"]:
        diffs.append(f"hits {sorted(tuple(h) for h in got['hits'])} != {sorted(ref['hits'])}")
    if got["probes"] != ref["probes"]:
        diffs.append(f"probes {got['probes']} != {ref['probes']}")
    if got["exhausted"] != ref["exhausted"]:
        diffs.append(f"budget_exhausted {got['exhausted']} != {ref['exhausted']}")
    # the i-th loss_fn call on every rank belongs to the same probe: join them into global masks
    probed = [(calls[0][0], {r: frozenset(tuple(t) for t in per_rank[r]["calls"][i][1])
                             for r in range(world) if per_rank[r]["calls"][i][1]})
              for i, calls in enumerate(zip(*(p["calls"] for p in per_rank)))]
    if probed != ref["masks"]:
        diffs.append("the probed masks differ")
    return diffs


@pytest.mark.parametrize("world", [2, 3, 4])
def test_gradloc_follows_the_official_rank_search(world, dist_results):
    results = dist_results(world)
    cases = port_cases(world)
    refs = {c["name"]: Reference(c, world).run(c["T"], c["budget"]) for c in cases}
    failures = {c["name"]: d for c in cases if (d := compare(c, results[c["name"]][1], world, refs[c["name"]]))}
    for c in cases:
        per_rank = results[c["name"]][1]
        assert all(p["hits"] == per_rank[0]["hits"] and p["probes"] == per_rank[0]["probes"] for p in per_rank)
    assert not failures, f"{len(failures)}/{len(cases)} cases differ from the official rules: {failures}"
    # the cases reach every rule: the give-up, an exact tie through the rank search, two
    # micro-batches, a token stage stopped by its budget, and unequal token counts
    assert any(refs[c["name"]]["micro_batch"] >= 0 and refs[c["name"]]["rank"] < 0 for c in cases)
    assert any(c["tie"] and refs[c["name"]]["micro_batch"] >= 0 for c in cases)
    assert any(c["K"] == 2 for c in cases) and any(r["exhausted"] for r in refs.values())
    assert all(len(set(c["density"])) == world for c in cases)
