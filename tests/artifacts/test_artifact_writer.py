"""The artifact writer: real localizer output rendered and logged, read back from every backend."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from gradloc_track.artifacts import SpikeArtifactWriter, read_table
from gradloc_track.config import TrackerConfig
from gradloc_track.spikes import SpikeContext
from gradloc_track.trackers import MemoryTracker, make_tracker

from ..wandb_reader import history
from .cases import HOSTILE, B, T


def test_writer_with_memory_tracker_keeps_columns_stable(spike, tmp_path):
    events, result, ctx = spike
    tracker = MemoryTracker()
    writer = SpikeArtifactWriter(tracker, run_dir=tmp_path)
    writer.write(7, events, result, ctx)
    ctx2 = SpikeContext(ctx.loss_fn, ctx.token_mask, ctx.input_ids, ctx.tokenizer)  # no extra columns
    writer.write(9, events, result, ctx2)
    table = tracker.tables["spikes/tokens"]
    assert [r[0] for r in table["rows"]] == [7, 9]
    assert table["rows"][1][-2:] == [None, None]
    assert [k for k, _, _ in tracker.html] == ["spikes/highlight", "spikes/highlight"]
    assert tracker.images and tracker.images[0][2].read_bytes()[:4] == b"\x89PNG"
    assert tracker.images[0][2].is_relative_to(tmp_path)
    assert tracker.tags["spike_count"] == "2"
    assert tracker.series("spike/culprits") == [(7, float(len(result.tokens))), (9, float(len(result.tokens)))]
    share = sum(c.share for c in result.tokens)
    assert tracker.series("spike/culprit_share") == [(7, pytest.approx(share)), (9, pytest.approx(share))]
    # a column that appears only at a later event is left out: the schema stays the first one
    ctx3 = SpikeContext(ctx.loss_fn, ctx.token_mask, ctx.input_ids, ctx.tokenizer,
                        extra_columns={"logprob": torch.zeros(B, T), "advantage": torch.ones(B, T)})
    writer.write(11, events, result, ctx3)
    assert table["columns"][-2:] == ["advantage", "reward"] and table["rows"][2][-2:] == [1.0, None]


def test_writer_renders_into_the_trackers_run_dir(spike, tmp_path):
    events, result, ctx = spike
    tracker = MemoryTracker(run_dir=tmp_path / "own")
    SpikeArtifactWriter(tracker).write(7, events, result, ctx)
    assert tracker.images[0][2].parent == tmp_path / "own" / "rendered"


def test_a_result_without_a_layer_map_gets_its_page_and_no_image_silently(spike, tmp_path):
    """A non-finite step's culprits are named from their losses, without a layer map: its page and table go out,
    no image, and no warning on the training's stderr (it said 'no heatmap image' at every such step; held-out
    tester round 8)."""
    import dataclasses
    import warnings

    events, result, ctx = spike
    bare = dataclasses.replace(result, layer_map=None)
    tracker = MemoryTracker()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        SpikeArtifactWriter(tracker, run_dir=tmp_path).write(7, events, bare, ctx)
    assert [k for k, _, _ in tracker.html] == ["spikes/highlight"] and tracker.images == []
    assert tracker.tables["spikes/tokens"]["rows"]


def test_a_spike_over_micro_batches_gets_the_heatmap_of_its_first_culprits_micro_batch(tmp_path):
    """Gradient accumulation: the result holds one layer map a micro-batch (``layer_maps``), none for the step;
    the heatmap is the first culprit's micro-batch's (round 9's tester: no image with accumulation, after the
    no-layer-map check moved before the micro-batch view)."""
    import dataclasses

    from .cases import T_LEVELS, levels_case

    events, result, ctx = levels_case()
    maps = [torch.rand(1, 2, T_LEVELS, generator=torch.Generator().manual_seed(k)) + 0.1 for k in range(3)]
    result = dataclasses.replace(result, layer_maps=maps)
    assert result.layer_map is None
    tracker = MemoryTracker()
    SpikeArtifactWriter(tracker, run_dir=tmp_path).write(12, events, result, ctx)
    (image,) = tracker.images
    assert image[2].read_bytes()[:4] == b"\x89PNG"


def test_writer_never_raises(spike, tmp_path):
    class Broken(MemoryTracker):
        def log_table(self, *a, **k):
            raise RuntimeError("disk full")

    events, result, ctx = spike
    with pytest.warns(UserWarning, match="disk full"):
        SpikeArtifactWriter(Broken(), tmp_path).write(7, events, result, ctx)


def test_local_run_dir_and_report(spike, tmp_path):
    from gradloc_track.report import build_report

    events, result, ctx = spike
    tracker = make_tracker(TrackerConfig(kind="none"), run_dir=tmp_path)
    SpikeArtifactWriter(tracker, tmp_path).write(7, events, result, ctx)
    tracker.finish()
    table = read_table(tmp_path, "spikes/tokens")
    assert table["data"][0][table["columns"].index("token")] == HOSTILE
    assert (tmp_path / "spikes" / "highlight" / "step_000007.html").exists()
    assert (tmp_path / "spikes" / "heatmap" / "step_000007.png").exists()
    page = build_report(str(tmp_path))
    assert "<script" not in page.lower() and "data:image/png;base64," in page
    assert "&lt;script&gt;alert(1)" in page and "step 7" in page


def test_wandb_offline_media_read_back(spike, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    events, result, ctx = spike
    tracker = make_tracker(TrackerConfig(kind="wandb"), run_dir=tmp_path / "run")
    writer = SpikeArtifactWriter(tracker, tmp_path / "run")
    for step in (7, 8, 9):
        writer.write(step, events, result, ctx)
    tracker.finish()
    (run,) = (tmp_path / "wandb").glob("offline-run-*")
    tables = sorted((run / "files" / "media" / "table").rglob("*.table.json"))
    cumulative = max((json.loads(p.read_text()) for p in tables if "tokens_all" in p.name),
                     key=lambda t: len(t["data"]))
    assert [r[0] for r in cumulative["data"]] == [7, 8, 9]
    token_col = cumulative["columns"].index("token")
    assert cumulative["data"][0][token_col] == HOSTILE
    pages = [p.read_text() for p in (run / "files" / "media" / "html").rglob("*.html")]
    assert len(pages) == 3 and all("&lt;script&gt;alert(1)" in p and "<script" not in p.lower() for p in pages)
    assert len(list((run / "files" / "media" / "images").rglob("*.png"))) == 3
    assert not (tmp_path / "run" / "spool").exists(), "records were spooled instead of logged"
    rows = history(run)
    steps = [r["train/step"] for r in rows if "spike/culprits" in r]
    assert steps == [7, 8, 9], sorted({k for r in rows for k in r})


def test_mlflow_store_read_back_after_100_events(spike, tmp_path, sqlite_uri):
    from mlflow.tracking import MlflowClient

    events, result, ctx = spike
    cfg = TrackerConfig(kind="mlflow")
    cfg.mlflow.tracking_uri = sqlite_uri
    tracker = make_tracker(cfg, run_dir=tmp_path / "run")
    writer = SpikeArtifactWriter(tracker, tmp_path / "run", images=False)  # images: tested above
    for step in range(100):
        writer.write(step, events, result, ctx)
    tracker.finish()
    client = MlflowClient(sqlite_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("gradloc-track").experiment_id])
    assert run.data.tags["spike_count"] == "100"
    assert len(run.data.tags.get("mlflow.loggedArtifacts", "")) < 200  # no path per event
    dl = Path(client.download_artifacts(run.info.run_id, "spikes", str(tmp_path / "dl")))
    table = read_table(dl.parent, "spikes/tokens")
    assert [r[0] for r in table["data"]] == list(range(100))
    assert len(list((dl / "highlight").glob("*.html"))) == 100
    assert "&lt;script&gt;" in (dl / "highlight" / "step_000042.html").read_text()


def test_close_removes_the_scratch_dir_and_keeps_a_given_one(spike, tmp_path, monkeypatch):
    """Without a run dir (neither given nor the tracker's) the heatmap is staged in a scratch dir of the
    system's temp dir: ``close()`` removes it (it was never removed), a given run dir stays."""
    import tempfile

    from gradloc_track.artifacts import artifact_writer

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    events, result, ctx = spike
    tracker = MemoryTracker()
    writer = SpikeArtifactWriter(tracker)
    writer.write(7, events, result, ctx)
    (scratch,) = (tmp_path / "tmp").iterdir()
    assert tracker.images[0][2].is_relative_to(scratch) and scratch in artifact_writer._scratch
    writer.close()
    assert not list((tmp_path / "tmp").iterdir()) and scratch not in artifact_writer._scratch
    SpikeArtifactWriter(MemoryTracker()).write(7, events, result, ctx)  # never closed (a monitor built by hand):
    artifact_writer._remove_scratch()  # the exit hook removes it
    assert not list((tmp_path / "tmp").iterdir())
    kept = SpikeArtifactWriter(MemoryTracker(), run_dir=tmp_path / "run")
    kept.write(7, events, result, ctx)
    kept.close()
    assert list((tmp_path / "run" / "rendered").glob("*.png"))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_leaving_does_not_remove_its_parents_scratch_dir(spike, temp_root):
    """The exit hook is inherited by a plain ``os.fork()`` child: one that exited normally removed the scratch
    dir its parent was still writing into (review of 997531a). Each dir is removed by the process that made it."""
    from gradloc_track.artifacts import artifact_writer

    events, result, ctx = spike
    writer = SpikeArtifactWriter(MemoryTracker())
    writer.write(7, events, result, ctx)
    (scratch,) = temp_root.iterdir()
    pid = os.fork()
    if pid == 0:  # the child: a close() (a handle's atexit finish), what its interpreter's exit would run, then
        writer.close()  # out without pytest's own teardown
        artifact_writer._remove_scratch()
        os._exit(0)
    os.waitpid(pid, 0)
    assert scratch.is_dir() and list(scratch.rglob("*.png"))
    writer.close()
    assert not scratch.exists()
