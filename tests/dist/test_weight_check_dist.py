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
