"""``run_dirs``: what a run dir is, the run dirs under a folder, and which run each one holds."""
from __future__ import annotations

import json
from pathlib import Path

from gradloc_track.run_dirs import detection_was_off, find_run_dirs, is_run_dir, run_dir_of, run_key, run_keys, \
    run_locations
from gradloc_track.trackers.run_record import update_run_record

MLFLOW_ID = "0123456789abcdef0123456789abcdef"


def make(root: Path, rel: str, marker: str) -> Path:
    """Folder ``rel`` holding ``marker`` (a file when it has a dot, else a folder)."""
    d = root / rel
    d.mkdir(parents=True, exist_ok=True)
    if "." in marker:
        (d / marker).write_text("{}")
    else:
        (d / marker).mkdir(parents=True)
    return d


def test_a_run_dir_is_known_by_what_a_run_writes(tmp_path):
    for i, marker in enumerate(("spikes", "tracker", "metrics.jsonl")):
        assert is_run_dir(make(tmp_path, f"r{i}", marker))
    wandb = tmp_path / "wandb" / "offline-run-20260101_120000-abc123"
    (wandb / "files").mkdir(parents=True)
    assert is_run_dir(wandb) and not is_run_dir(wandb.parent)
    assert not is_run_dir(make(tmp_path, "docs", "ledger.md")) and not is_run_dir(tmp_path / "missing")
    run = tmp_path / "r0"
    assert run_dir_of(run / "spikes") == run and run_dir_of(run) == run and run_dir_of(tmp_path / "docs") is None


def test_a_folder_is_searched_but_not_inside_a_run_dir_nor_hidden_folders(tmp_path):
    a = make(tmp_path, "sweepA/0_clip=adagc", "spikes")
    b = make(tmp_path, "sweepB/deep/er/0_clip=adagc", "tracker")
    make(a, "wandb/offline-run-20260101_120000-abc123/files", "media")  # W&B's folder inside a run dir
    make(tmp_path, ".hydra/x", "spikes")
    make(tmp_path, "docs", "index.md")
    assert find_run_dirs(tmp_path) == [a, b]
    assert find_run_dirs(tmp_path / "docs") == []


def test_a_runs_identity_is_the_run_it_logged_to_never_its_folder_name(tmp_path):
    a, b = make(tmp_path, "sweepA/0_clip=adagc", "spikes"), make(tmp_path, "sweepB/0_clip=adagc", "spikes")
    assert run_key(a) != run_key(b) and run_key(a) == str(a.resolve())
    update_run_record(b, "mlflow", view={"run_id": MLFLOW_ID, "tracking_uri": "sqlite:///x.db"})
    assert run_key(b) == MLFLOW_ID
    joined = make(tmp_path, "joined", "spikes")  # a joined run on main: its reference, no view
    update_run_record(joined, "mlflow", spec={"run_id": MLFLOW_ID, "joined": True},
                      run={"run_id": MLFLOW_ID, "experiment_id": "1", "tracking_uri": "sqlite:///x.db"})
    assert run_locations(joined) == {"mlflow": {"run_id": MLFLOW_ID, "experiment_id": "1",
                                                "tracking_uri": "sqlite:///x.db"}}
    assert run_key(joined) == MLFLOW_ID
    w = make(tmp_path, "w", "spikes")
    update_run_record(w, "wandb", view={"path": "me/proj/abc123", "dir": "/x/offline-run-20260101_120000-abc123"})
    wfolder = tmp_path / "offline-run-20260101_120000-abc123"
    (wfolder / "files").mkdir(parents=True)
    assert run_key(w) == run_key(wfolder) == "wandb:abc123"  # the same W&B run, however it is reached
    (tmp_path / "broken" / "tracker").mkdir(parents=True)
    (tmp_path / "broken" / "tracker" / "mlflow.json").write_text(json.dumps({"view": "not a dict"}))
    assert run_locations(tmp_path / "broken") == {}


def test_a_tracker_both_run_is_known_by_each_of_its_tracker_runs(tmp_path):
    """``tracker=both``: one run dir, an MLflow run and a W&B run (its folder inside the run dir). Each identity
    leads to the others, so the ledger counts the run once whichever it is given by (held-out tester, stop 63: the
    run dir and its W&B folder, or the experiment and that folder, were two runs)."""
    run = make(tmp_path, "runs/2026-12-01_03-00-00", "spikes")
    update_run_record(run, "mlflow", view={"run_id": MLFLOW_ID, "tracking_uri": "sqlite:///x.db"})
    update_run_record(run, "wandb", view={"path": "me/proj/abc123"})
    folder = run / "wandb" / "offline-run-20261201_030000-abc123"
    (folder / "files").mkdir(parents=True)
    assert run_keys(run) == [MLFLOW_ID, "wandb:abc123", str(run.resolve())]
    assert run_keys(folder)[:2] == ["wandb:abc123", str(folder.resolve())] and MLFLOW_ID in run_keys(folder)
    other = tmp_path / "elsewhere" / "wandb" / "offline-run-20261201_030000-zzz999"  # another run's, not inside
    (other / "files").mkdir(parents=True)
    assert run_keys(other) == ["wandb:zzz999", str(other.resolve())]
    stranger = run / "wandb" / "offline-run-20261201_040000-def456"  # a W&B run the run dir did not record
    (stranger / "files").mkdir(parents=True)
    assert MLFLOW_ID not in run_keys(stranger)


def test_a_run_without_a_spike_detector_is_told_from_one_that_found_no_spike(tmp_path, capsys):
    """Held-out tester, stop 63: a run with spikes.enabled=false read as one that logged no spike events (the report,
    the ledger). Its params.json (tracker=none) or the demo's config.yaml says the detector was off."""
    from gradloc_track.cli import main

    local = make(tmp_path, "local", "metrics.jsonl")
    (local / "params.json").write_text(json.dumps({"spikes.enabled": False, "clip.kind": "none"}))
    demo = make(tmp_path, "demo", "metrics.jsonl")
    (demo / "config.yaml").write_text("spikes:\n  enabled: false\n  z_thresh: 8.0\nclip:\n  enabled: true\n")
    clean = make(tmp_path, "clean", "metrics.jsonl")
    (clean / "params.json").write_text(json.dumps({"spikes.enabled": True}))
    (make(tmp_path, "odd", "metrics.jsonl") / "config.yaml").write_text("[not: a mapping")
    assert detection_was_off(local) and detection_was_off(demo)
    assert not detection_was_off(clean) and not detection_was_off(tmp_path / "odd")
    assert main(["report", str(local), "-o", str(tmp_path / "r.html")]) == 2
    assert "its spike detector was off (spikes=False, spikes.enabled=false): no spike was looked for" in \
        capsys.readouterr().err
    assert main(["report", str(clean), "-o", str(tmp_path / "r.html")]) == 2
    assert "it logged no spike events" in capsys.readouterr().err


def test_a_w_and_b_folder_alone_tells_a_run_without_a_spike_detector_from_a_clean_one(tmp_path, monkeypatch, capsys):
    """Stop 63 left a ``spikes=False`` W&B run without a marker: its W&B folder alone (kept outside the run dir by
    ``WANDB_DIR``) read as a run that logged no spike events. Offline, W&B keeps the run's config in its binary log
    only; the params ``watch()`` logs are now also in our file in the run's files. A real W&B offline run."""
    import torch

    import gradloc_track
    from gradloc_track.cli import main
    from gradloc_track.demo.model import TinyGPT
    from gradloc_track.trackers.naming import RUN_FILE

    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-root"))
    folders = {}
    for detecting in (False, True):
        torch.manual_seed(0)
        model = TinyGPT(vocab_size=32, n_layer=1, n_head=1, d_model=8, max_seq_len=8)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        run = tmp_path / f"run-{detecting}"
        handle = gradloc_track.watch(model, opt, tracker="wandb", run_dir=run, spikes=detecting, console=False)
        for _ in range(3):
            x = torch.randint(0, 32, (2, 9))
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[:, :-1]).reshape(-1, 32), x[:, 1:].reshape(-1)).backward()
            opt.step()
        handle.finish()
        folder = Path(json.loads((run / "tracker" / "wandb.json").read_text())["view"]["dir"])
        assert not folder.is_relative_to(run)
        assert json.loads((folder / "files" / RUN_FILE).read_text())["params"]["spikes.enabled"] is detecting
        folders[detecting] = folder
    assert detection_was_off(folders[False]) and not detection_was_off(folders[True])
    assert main(["report", str(folders[False]), "-o", str(tmp_path / "r.html")]) == 2
    assert "its spike detector was off" in capsys.readouterr().err
    assert main(["report", str(folders[True]), "-o", str(tmp_path / "r.html")]) == 2
    assert "it logged no spike events" in capsys.readouterr().err
