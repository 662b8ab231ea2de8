"""``watch(..., spikes={"quarantine": True})`` under DDP (2 gloo processes; a hang fails). Held-out distributed tester,
stop 56: the handle blamed through rank 0's gathered view only, so rank 1's quarantine stayed empty and the garbage
row it had fed came back there and trained again; and a NaN multiplier on one rank (``irreproducible``: the replay
is finite) had the replay's four largest rows, all clean, quarantined, while the multi-process search never said
the replay is finite where ``.grad`` is not. Now every rank blames every rank's culprits, only on a step the data
made, and every rank's result carries the replay finding."""
from __future__ import annotations

import json

from . import quarantine_worker as w
from .launch import fork_ranks


def test_every_rank_quarantines_every_culprit_and_no_clean_row(tmp_path):
    fork_ranks(w.main, 2, (str(tmp_path),), timeout=240)
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r, s in enumerate(seen):
        assert s["spikes"][str(w.INJECT_AT)]["cause"] == "data", s["spikes"]
        assert list(s["blamed_at"].values()) == [w.INJECT_AT], (r, s["blamed_at"])  # the garbage row, nothing else
    assert seen[0]["blamed_at"] == seen[1]["blamed_at"]
    # the garbage row is skipped wherever it comes back: rank 1 (its own) and rank 0
    assert seen[1]["skipped"] == [[w.AGAIN, 1]] and seen[0]["skipped"] == [[w.AGAIN_0, 1]], seen
    for s in seen:
        nan = s["spikes"][str(w.NAN_AT)]
        assert nan["cause"] == "irreproducible" and nan["nonfinite"] == "replay", nan
    assert seen[0]["spikes"] == seen[1]["spikes"]


def test_a_nan_in_one_ranks_shard_is_found_on_every_rank(tmp_path):
    """FSDP2: ``.grad`` NaN in rank 1's shard only, the replay finite. Every rank's result says so (review of
    4186cbd: the search attached the finding per rank, from its own shard: rank 1 had it, rank 0, which writes
    the artifacts and the console, did not)."""
    from . import replay_nan_worker

    fork_ranks(replay_nan_worker.main, 2, (str(tmp_path),), timeout=180)
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert seen[0] == seen[1] and seen[0]["where"] == "replay", seen
    assert "wte.weight" in seen[0]["detail"], seen
