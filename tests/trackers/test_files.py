"""Local file writes (``trackers/files.py``): whole records or none, and the modes the umask asks for."""
from __future__ import annotations

import json
import os
import stat
import warnings

import pytest

from gradloc_track.trackers import LocalTracker, files, read_spool
from gradloc_track.trackers.local_tracker import read_metrics
from gradloc_track.trackers.spool import Spool

PAD = "x" * 60  # ~100-byte lines: a few dozen fill the page left on the disk


def test_a_torn_line_on_a_full_disk_is_never_glued_to_the_next_record(tight_disk, capsys):
    tracker = LocalTracker(tight_disk.dir / "run")
    tight_disk.fill()
    for step in range(300):
        if step == 200:
            tight_disk.free()
        tracker.log_metrics({"loss": float(step), "pad": PAD}, step)
    tracker.finish("success")
    lines = (tight_disk.dir / "run" / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(line)["step"] for line in lines]  # every line is one whole record
    with capsys.disabled():
        print(f"\ntracker=none on a full disk: {len(steps)} written of 300, {tracker.dropped} dropped")
    assert steps == list(range(300)) and tracker.dropped == 0  # the lines that waited went in, in order
    assert [r["step"] for r in read_metrics(tight_disk.dir / "run")] == steps


def test_the_spool_counts_exactly_what_a_full_disk_lost(tight_disk, capsys):
    spool = Spool(tight_disk.dir / "spool" / "b.jsonl", "b")
    tight_disk.fill()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i in range(200):
            if i == 150:
                tight_disk.free()
            spool.write("log_metrics", [{"x": float(i), "pad": PAD}, i], "down")
    recs = read_spool(spool.path)
    with capsys.disabled():
        print(f"\nspool on a full disk: {len(recs)} readable + {spool.dropped} dropped of 200")
    assert 0 < spool.dropped and len(recs) + spool.dropped == 200 and spool.count == len(recs)
    assert [r["args"][1] for r in recs][-50:] == list(range(150, 200))


def test_readers_skip_a_torn_tail_and_the_next_append_starts_a_new_line(tmp_path):
    path = tmp_path / "m.jsonl"
    files.append_line(path, json.dumps({"step": 0, "metrics": {}}))
    with open(path, "a") as f:
        f.write('{"step": 1, "metr')  # a kill mid-write
    assert [r["step"] for r in read_metrics(tmp_path, "m.jsonl")] == [0]
    files.append_line(path, json.dumps({"step": 2, "metrics": {}}))
    assert [r["step"] for r in read_metrics(tmp_path, "m.jsonl")] == [0, 2]


@pytest.mark.parametrize("umask", [0o022, 0o002])
def test_atomic_writes_follow_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        files.atomic_write_text(tmp_path / "a.json", "{}")
        files.append_line(tmp_path / "b.jsonl", "{}")
    finally:
        os.umask(old)
    for name in ("a.json", "b.jsonl"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o666 & ~umask, name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "b.jsonl"]  # no temp file left


def test_a_rewrite_is_synced_before_the_rename_and_an_error_leaves_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "b.json"
    files.atomic_write_text(path, "old")
    order = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (order.append("fsync"), real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (order.append("replace"), real_replace(a, b))[1])
    with files.atomic_file(path) as f:
        f.write("new")
    assert order == ["fsync", "replace", "fsync"]  # the data, the rename, then the folder
    assert path.read_text() == "new"
    with pytest.raises(RuntimeError):
        with files.atomic_file(path) as f:
            f.write("half")
            raise RuntimeError("killed mid-write")
    assert path.read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["b.json"]


# files that write without trackers/files, and why that is not a file of ours being rewritten
NOT_OURS = {
    "demo/tokenizer.py": "the tokenizers library saves to a temp file; os.replace puts it in place",
    "artifacts/heatmap.py": "matplotlib's savefig into memory (the PNG is then staged atomically in rendered/)",
    "integrations/checkpoint_state.py": "torch.save into memory (then atomic_write_bytes into the checkpoint)",
    "trackers/mlflow_tracker.py": "a copy in a TemporaryDirectory, for MLflow to upload",
    "trackers/wandb_tracker.py": "run.save: W&B copies and uploads the file",
}


def test_every_file_of_ours_is_written_through_the_atomic_helpers():
    import re
    from pathlib import Path

    import gradloc_track

    package = Path(gradloc_track.__file__).parent
    raw = re.compile(r"\.write_text\(|\.write_bytes\(|open\([^)]*['\"][wax]b?['\"]|json\.dump\(|os\.replace\(|"
                     r"savefig\(|\.save\(")
    writers = {p.relative_to(package).as_posix() for p in package.rglob("*.py")
               if p.name != "files.py" and raw.search(p.read_text(encoding="utf-8"))}
    assert writers == set(NOT_OURS), f"write through gradloc_track.trackers.files: {sorted(writers - set(NOT_OURS))}"
