"""A corrupt weight on one rank's shard is one finding on every rank (``monitor/weight_check.py``): the
ranks must agree, since the next detected steps skip localizing, a collective. 2 and 4 gloo processes,
FSDP2 (the weight on one rank's shard); a hang fails."""
from __future__ import annotations

import json

import pytest

from . import weight_worker
from .launch import fork_ranks


@pytest.mark.parametrize("world,wrap", [(2, "fsdp2"), (4, "fsdp2")])
def test_every_rank_names_the_same_corrupt_weight(tmp_path, world, wrap):
    fork_ranks(weight_worker.main, world, (str(tmp_path), wrap), timeout=120)
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]
    assert all(g == got[0] for g in got), got
    first = got[0]
    assert first["healthy"] and first["still"] and first["healed"] and first["step"] == 6
    assert first["name"].endswith("h.1.mlp.fc.weight")


@pytest.mark.parametrize("world", [2, 4])
def test_a_weight_corrupt_on_one_replica_is_one_event_on_every_rank(tmp_path, world):
    """Review of b5baf6d: the weight norm is each replica's own under DDP; the scan it triggers is a collective.
    A 1e36 weight on the last replica only (behind LayerNorm: no norm fires) made that rank scan alone and hang.
    The 'not finite' reading rides with the detector's other inputs, combined across ranks: every rank scans."""
    fork_ranks(weight_worker.monitor_main, world, (str(tmp_path),), timeout=120)
    got = [json.loads((tmp_path / f"monitor{r}.json").read_text()) for r in range(world)]
    assert all(g == got[0] for g in got), got
    fired = [(step, signals) for step, signals, _ in got[0] if signals]
    assert fired and fired[0] == (8, ["weight_norm"]), fired
    assert got[0][8][2].startswith("a weight is absurd: wte.weight[")
    assert not any("weight_norm" in signals for step, signals, _ in got[0][9:])  # one event, not one per step
