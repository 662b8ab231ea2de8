"""A run dir on a full disk (``trackers/incomplete.py``, ``kept_writes.py``): the run used to exit 0 with
nothing on stderr, the spike's table never written, a 0-byte heatmap, then ``report`` wrote an empty
page and ``culprits`` counted 0 spike events, both exit 0. Now the failure is said at once and in the
closing lines, what could not be written is kept and written when there is room (or into a folder of
its own at the end), and ``report``/``culprits`` say the run dir is incomplete with a non-zero exit.
On a real tmpfs when the tests may mount one (root), else ENOSPC injected where our files are written."""
from __future__ import annotations

import json
import warnings

from gradloc_track.artifacts import SpikeArtifactWriter
from gradloc_track.cli import main
from gradloc_track.config import TrackerConfig
from gradloc_track.trackers import MemoryTracker, make_tracker
from gradloc_track.trackers.async_writer import AsyncTracker

from ..artifacts.cases import make_case

PNG = b"\x89PNG\r\n\x1a\n"
STEPS = [0, 1, 2, 9, *range(3, 12)]  # every metrics line, in the order logged (the spike's at step 9)


def spike_on_a_full_disk(disk):
    """tracker=none: a few steps, then the disk fills, then a localized spike is written."""
    run = disk.dir / "run"
    tracker = make_tracker(TrackerConfig(kind="none"), run_dir=run)
    for step in range(3):
        tracker.log_metrics({"loss": 1.0}, step)
    disk.fill()
    events, result, ctx = make_case(T=40, culprits=((0, 5),), pad_from=30)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the heatmap's staging note)
        SpikeArtifactWriter(tracker, run, window=8).write(9, events, result, ctx)
        for step in range(3, 12):
            tracker.log_metrics({"loss": 1.0, "pad": "x" * 200}, step)
        tracker.flush()
    return tracker, run


def test_a_spike_on_a_full_disk_is_said_kept_and_the_readers_say_incomplete(tight_disk, tmp_path, capsys):
    tracker, run = spike_on_a_full_disk(tight_disk)
    said = capsys.readouterr().err
    assert said.count("the run dir is INCOMPLETE from here on") == 1  # at once, once
    tracker.finish("success")  # the disk is still full at the end
    closing = capsys.readouterr().err
    assert f"the run dir {run} is INCOMPLETE (No space left on device" in closing
    kept = next(line.split("They are kept in ")[1].split(";")[0] for line in closing.splitlines() if "kept in" in line)
    kept = tight_disk.dir.__class__(kept)
    def where(rel):  # in the run dir if it fit in the page left, else kept
        return next(p for p in (run / rel, kept / rel) if p.is_file())
    assert json.loads(where("spikes/tokens/step_000009.json").read_text())["data"]  # the table, whole
    assert where("spikes/heatmap/step_000009.png").read_bytes().startswith(PNG)
    assert not [p for p in run.rglob("*.png") if p.stat().st_size == 0]  # never a 0-byte image
    assert (run / "INCOMPLETE").exists()

    assert main(["report", str(run), "-o", str(tmp_path / "r.html")]) == 1
    assert "is INCOMPLETE" in capsys.readouterr().err and "INCOMPLETE" in (tmp_path / "r.html").read_text()
    assert main(["culprits", str(run), "-o", str(tmp_path / "ledger")]) != 0
    assert "is INCOMPLETE" in capsys.readouterr().err

    tight_disk.free()  # the closing lines' commands put the run dir back together
    for line in closing.splitlines():
        if line.strip().startswith(("cat ", "cp ")):
            import subprocess

            subprocess.run(line.strip(), shell=True, check=True)
    assert main(["report", str(run), "-o", str(tmp_path / "r2.html")]) == 0
    assert main(["culprits", str(run), "-o", str(tmp_path / "ledger2")]) == 0
    assert json.loads((tmp_path / "ledger2" / "culprits.json").read_text())["spike_events"] == 1
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == STEPS


def test_room_again_before_the_end_writes_everything_into_the_run_dir(tight_disk, tmp_path, capsys):
    tracker, run = spike_on_a_full_disk(tight_disk)
    tight_disk.free()
    tracker.finish("success")
    assert "it is complete" in capsys.readouterr().err
    assert not (run / "INCOMPLETE").exists()
    assert (run / "spikes" / "heatmap" / "step_000009.png").read_bytes().startswith(PNG)
    assert main(["report", str(run), "-o", str(tmp_path / "r.html")]) == 0
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == STEPS


def test_a_heatmap_with_no_room_in_the_run_dir_still_reaches_the_tracker(tight_disk):
    """tracker=mlflow/wandb: the run dir only stages the heatmap (rendered/); a full one made it 0 bytes."""
    backend = MemoryTracker()
    run = tight_disk.dir / "run"
    tracker = AsyncTracker(lambda: backend, "mem", run)
    tight_disk.fill()
    events, result, ctx = make_case(T=40, culprits=((0, 5),), pad_from=30)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        SpikeArtifactWriter(tracker, run, window=8).write(9, events, result, ctx)
        tracker.finish()
    ((key, step, path),) = backend.images
    assert (key, step) == ("spikes/heatmap", 9) and path.read_bytes().startswith(PNG)
    assert [(k, s) for k, s, _ in backend.html] == [("spikes/highlight", 9)]


def test_an_apps_own_file_on_a_full_disk_is_kept_elsewhere_not_raised(tight_disk, capsys):
    """The demo's summary.json on a full disk ended the run at its last step with a traceback."""
    from gradloc_track.trackers.incomplete import write_run_file

    run = tight_disk.dir / "run"
    run.mkdir()
    tight_disk.fill()
    path = write_run_file(run, "summary.json", json.dumps({"final_loss": 1.0, "pad": "x" * 8000}))
    assert path is not None and path.parent != run and json.loads(path.read_text())["final_loss"] == 1.0
    said = capsys.readouterr().err
    assert "cannot write summary.json" in said and f"summary.json is kept in {path}" in said
    assert (run / "INCOMPLETE").exists()


def test_the_first_failure_says_what_becomes_of_what_could_not_be_written(tmp_path, capsys):
    """Held-out tester, stop 54: a full disk under an MLflow spool printed 'what cannot be written is kept in
    memory and written when there is room again', then 'LOST' about the same records: a spool's records are not
    kept. The first line now says which."""
    import errno

    from gradloc_track.trackers.incomplete import RunDirWrites

    full = OSError(errno.ENOSPC, "No space left on device")
    RunDirWrites(tmp_path / "a").failed("spool/mlflow.jsonl", full, kept=False)
    lost = capsys.readouterr().err
    assert "what spool/mlflow.jsonl would have held is LOST while there is no room" in lost
    assert "kept in memory" not in lost
    RunDirWrites(tmp_path / "b").failed("metrics.jsonl", full, kept=True)
    assert "is kept in memory and written when there is room again" in capsys.readouterr().err
