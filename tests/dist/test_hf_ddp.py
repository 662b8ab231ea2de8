"""HF Trainer under DDP (2 gloo processes) with ``GradLocCallback``: the spike a garbage row makes on rank 1 is
localized (callbacks are handed the bare model, whose probes never all-reduce: every localization failed its
step check, 'the gradient differs across ranks', held-out tester round 8), every rank agrees, and rank 0's
table names the row by its dataset index."""
from __future__ import annotations

import json

import pytest

from gradloc_track.artifacts import read_table

from . import hf_worker
from .launch import fork_ranks


@pytest.mark.slow
def test_hf_trainer_under_ddp_localizes_the_garbage_row_on_every_rank(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("datasets")
    fork_ranks(hf_worker.main, 2, (str(tmp_path),), timeout=300)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    step = hf_worker.BAD // hf_worker.ROWS_A_STEP + 1
    assert [[s["step"] for s in seen] for seen in ranks] == [[s["step"] for s in ranks[0]]] * 2  # one decision
    at = [next(s for s in seen if s["step"] == step) for seen in ranks]
    assert all(s["replayed"] and s["why_not"] is None and s["cause"] == "data" for s in at), at
    # the rebuilt loss is Trainer's, in its units: Trainer multiplies a loss over the count of every process's
    # tokens by the processes (average_tokens_across_devices), and the probes were 1/2 of the step (held-out
    # tester, stop 55: each culprit's norm half the one-process run's; norm_ratio and scale 2.0)
    assert all(s["norm_ratio"] == pytest.approx(1.0, abs=1e-3) and s["scale"] == pytest.approx(1.0, abs=1e-3)
               for s in at), at
    assert at[0]["culprits"] and at[0]["culprits"][0][0] == 1  # the row was on rank 1
    table = read_table(tmp_path / "run")
    rows = [dict(zip(table["columns"], r)) for r in table["data"]]
    assert [r["dataset_index"] for r in rows if r["step"] == step][:1] == [hf_worker.BAD]
