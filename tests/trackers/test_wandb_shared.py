"""Our records in the user's own W&B run (``trackers/wandb_shared.py``), offline, read back: W&B's
step stays the user's whatever they log; what had to share a row is counted and said."""
from __future__ import annotations

import pytest

from gradloc_track.config import TrackerConfig
from gradloc_track.trackers.join import RunDir, join_wandb

from ..wandb_reader import history


def user_run(tmp_path):
    import wandb

    return wandb.init(project="shared", dir=str(tmp_path), mode="offline")


def rows_of(tmp_path):
    return history(next(tmp_path.rglob("offline-run-*")))


def test_a_user_logging_every_third_step_keeps_every_point_and_is_told_what_shared_a_row(tmp_path):
    run = user_run(tmp_path)
    try:
        tracker = join_wandb(run, None, TrackerConfig(), RunDir(tmp_path / "spool"))
        for it in range(30):
            tracker.log_metrics({"grad_norm/global": float(it)}, it)  # the optimizer hook, then the user's log
            if it % 3 == 0:
                run.log({"train/loss": float(it)}, step=it)
        with pytest.warns(RuntimeWarning, match=r"of our W&B records shared a row of your run"):
            tracker.finish()
    finally:
        run.finish()
    rows = rows_of(tmp_path)
    assert [r["train/loss"] for r in rows if "train/loss" in r] == [float(it) for it in range(0, 30, 3)]
    ours = [r["gradloc/step"] for r in rows if "grad_norm/global" in r]
    assert ours == sorted(set(ours)) and 10 <= len(ours) < 30  # one per row of the user's, never a row of ours
    assert max(r["_step"] for r in rows) == 27  # W&B's step never went past the user's


def test_a_silent_owner_gets_rows_of_ours_at_the_training_step(tmp_path):
    run = user_run(tmp_path)
    try:
        tracker = join_wandb(run, None, TrackerConfig(), RunDir(tmp_path / "spool"))
        with pytest.warns(RuntimeWarning, match=r"no row of its own since watch\(\) joined it"):
            for it in range(12):
                tracker.log_metrics({"grad_norm/global": float(it)}, it)
            tracker.finish()
    finally:
        run.finish()
    ours = [(r["_step"], r["gradloc/step"]) for r in rows_of(tmp_path) if "grad_norm/global" in r]
    assert [s for _, s in ours] == list(range(12))
    assert all(row <= step for row, step in ours)  # W&B's step never ahead of the training step
