"""Our records in the user's own W&B run (``trackers/wandb_shared.py``), offline, read back: W&B's
step stays the user's whatever they log; what had to share a row is counted and said."""
from __future__ import annotations

import pytest

from gradloc_track.config import TrackerConfig
from gradloc_track.trackers.join import OpenRuns, RunDir, join_runs

from ..wandb_reader import history


def user_run(tmp_path):
    import wandb

    return wandb.init(project="shared", dir=str(tmp_path), mode="offline")


def rows_of(tmp_path):
    return history(next(tmp_path.rglob("offline-run-*")))


def test_a_user_logging_every_third_step_keeps_every_point_and_is_told_what_shared_a_row(tmp_path):
    run = user_run(tmp_path)
    try:
        tracker = join_runs(OpenRuns(wandb=run), TrackerConfig(), RunDir(tmp_path / "spool"))
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
        tracker = join_runs(OpenRuns(wandb=run), TrackerConfig(), RunDir(tmp_path / "spool"))
        with pytest.warns(RuntimeWarning, match=r"no row of its own since watch\(\) joined it"):
            for it in range(12):
                tracker.log_metrics({"grad_norm/global": float(it)}, it)
            tracker.finish()
    finally:
        run.finish()
    ours = [(r["_step"], r["gradloc/step"]) for r in rows_of(tmp_path) if "grad_norm/global" in r]
    assert [s for _, s in ours] == list(range(12))
    assert all(row <= step for row, step in ours)  # W&B's step never ahead of the training step


def test_a_spikes_media_sit_at_its_own_step_whatever_the_user_logs_in_between(tmp_path):
    """Spikes at steps 41 and 43 of a user logging one row per iteration (and an extra one at 45):
    their tables land in the spike's own row; their HTML and image, rendered later on the writer's
    thread, at ``gradloc/media_step`` 41 and 43 in later rows, next to our metrics of those rows. Every
    metric keeps its own row and step (no row shared, no warning); W&B's step stays the user's."""
    import threading
    import warnings

    from gradloc_track.config import TrackerConfig
    from gradloc_track.trackers.async_writer import AsyncTracker
    from gradloc_track.trackers.wandb_shared import SharedRunTracker
    from gradloc_track.trackers.wandb_tracker import WandbTracker

    from ..wandb_reader import complete_records
    from .calls import png

    image, released = png(tmp_path / "heatmap.png"), {41: threading.Event(), 43: threading.Event()}

    def render(step):  # the writer's thread renders a spike's page long after its step
        def job(t):
            released[step].wait(30)
            t.log_html("spikes/highlight", f"<p>spike {step}</p>", step)
            t.log_image("spikes/heatmap", image, step)
        return job

    run = user_run(tmp_path)
    try:
        adapter = WandbTracker(run=run, step_key="", shared_rows=True, run_dir=tmp_path / "spool")
        tracker = SharedRunTracker(adapter, AsyncTracker.from_config(TrackerConfig(), "wandb", lambda: adapter,
                                                                     tmp_path / "spool"))
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # nothing shares a row
            for it in range(60):
                tracker.log_metrics({"grad_norm/global": float(it)}, it)  # the optimizer hook...
                if it in released:
                    tracker.log_table("spikes/events", ["step"], [[it]], it)
                    tracker.log_table("spikes/tokens", ["step", "token"], [[it, "bad"]], it)
                    tracker.submit(render(it))
                if it == 50:
                    released[41].set(), released[43].set()
                run.log({"train/loss": float(it)})  # ...then the user's row
                if it == 45:
                    run.log({"eval/loss": 0.0})  # a row of the user's with nothing of ours
            tracker.finish()
    finally:
        run.finish()
    run_dir = next(tmp_path.rglob("offline-run-*"))
    rows = history(run_dir)

    def media(key):
        return [(r["gradloc/media_step"], r.get("gradloc/step")) for r in rows if f"{key}/_type" in r]

    assert media("spikes/events") == [(41, 41), (43, 43)] and media("spikes/tokens") == [(41, 41), (43, 43)]
    for key in ("spikes/highlight", "spikes/heatmap"):
        assert [m for m, _ in media(key)] == [41, 43]
        assert all(s is None or s >= 50 for _, s in media(key))  # later rows: ours of those steps stay there
    assert [r["gradloc/step"] for r in rows if "grad_norm/global" in r] == list(range(60))
    assert [r["train/loss"] for r in rows if "train/loss" in r] == [float(it) for it in range(60)]
    assert max(r["_step"] for r in rows if "grad_norm/global" in r) == 60  # 60 rows + the user's extra one
    axes = {rec.metric.name: rec.metric.step_metric for rec in complete_records(run_dir)
            if rec.WhichOneof("record_type") == "metric" and rec.metric.name.startswith("spikes/")}
    assert axes["spikes/highlight"] == axes["spikes/tokens"] == "gradloc/media_step"
    assert set(axes.values()) == {"gradloc/media_step"}  # every sub-key W&B flattens a media value into
