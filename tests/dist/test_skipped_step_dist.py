"""One rank skips ``optimizer.step()`` under DDP (a per-rank ``if torch.isfinite(loss)``): plain DDP does
not hang on it, but ``watch()``'s detector all-gathers at the step, so the peers wait there. Held-out
distributed tester, stop 54: the peers waited until gloo's timeout, then died on a bare "Timed out waiting
... for recv". Now the waiting rank is told why while it waits, and its error names the fix. 2 gloo
processes; a hang fails."""
from __future__ import annotations

import json

from . import skip_worker
from .launch import fork_ranks


def test_a_rank_that_skips_the_step_is_named_as_the_likely_cause(tmp_path):
    fork_ranks(skip_worker.main, 2, (str(tmp_path),), timeout=90)
    seen = json.loads((tmp_path / "rank0.json").read_text())
    assert seen["steps"] == list(range(skip_worker.SKIP_AT)), seen  # step 3 never completed on rank 0
    assert any("has waited" in w and "every rank must call optimizer.step()" in w for w in seen["warnings"]), seen
    assert seen["error"] and "all-gather of the spike detector's inputs" in seen["error"], seen
    assert "skip optimizer.step()" in seen["error"], seen
