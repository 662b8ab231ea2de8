"""The W&B adapter (``trackers/wandb_tracker.py``) in offline mode, read back from the run files it wrote."""
from __future__ import annotations

import json

from gradloc_track.config import TrackerConfig
from gradloc_track.trackers import make_tracker

from gradloc_track.trackers import read_spool

from ..wandb_reader import history, summary
from .calls import exercise


def test_wandb_offline_run_files_read_back(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    tracker = make_tracker(TrackerConfig(kind="wandb"), run_dir=tmp_path / "run", run_name="t")
    exercise(tracker, tmp_path)
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    rows = history(run_dir)
    norms = {(r["train/step"], r["grad_norm/global"]) for r in rows if "grad_norm/global" in r}
    assert norms == {(s, 1.0 + s) for s in range(5)}
    tables = sorted((run_dir / "files" / "media" / "table").rglob("*.table.json"))
    cumulative = [json.loads(p.read_text()) for p in tables if "tokens_all" in p.name]
    assert [len(t["data"]) for t in cumulative] == [6]  # all rows of all 3 events, logged once
    per_event = [json.loads(p.read_text()) for p in tables if "tokens_all" not in p.name]
    assert sorted(len(t["data"]) for t in per_event) == [2, 2, 2]
    # media sit at the training step: W&B's own step (the media slider) is ours
    media = [r for r in rows if any(k.split("/_")[0].rsplit("/", 1)[0] in ("spikes/highlight", "spikes/heatmap",
                                                                          "spikes/tokens") for k in r)]
    assert media and all(r["_step"] == r["train/step"] for r in media), media
    assert {r["train/step"] for r in media} == {10, 11, 12}
    (html,) = list((run_dir / "files" / "media" / "html").rglob("*.html"))
    text = html.read_text()
    assert "culprit" in text and "<link" not in text and "stylesheet" not in text
    assert list((run_dir / "files" / "media" / "images").rglob("*.png"))
    assert summary(run_dir)["spike_count"] == 3  # a number from the history, not the tag's string (sorted as text)


def test_wandb_table_grows_linearly_over_100_events(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    tracker = make_tracker(TrackerConfig(kind="wandb"), run_dir=tmp_path / "run")
    for e in range(100):
        tracker.log_table("spikes/tokens", ["step", "token"], [[e, f"tok{e}"]], e)
    tracker.finish("success")
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    files = list((run_dir / "files" / "media" / "table").rglob("*.table.json"))
    tables = {p: json.loads(p.read_text()) for p in files}
    (cumulative,) = [t for p, t in tables.items() if "tokens_all" in p.name]  # logged once, at finish
    assert [r[0] for r in cumulative["data"]] == list(range(100))  # every event, in order, once
    assert sorted(len(t["data"]) for p, t in tables.items() if "tokens_all" not in p.name) == [1] * 100
    total = sum(p.stat().st_size for p in files)
    assert total < 3 * 2 * cumulative_size(cumulative), "table bytes must grow linearly with the events"
    rows = [r for r in history(run_dir) if "spikes/tokens/nrows" in r]
    assert [(r["_step"], r["train/step"]) for r in rows] == [(e, e) for e in range(100)]


def cumulative_size(table) -> int:
    return len(json.dumps(table))


def test_wandb_config_file_keeps_its_own_name(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    tracker = make_tracker(TrackerConfig(kind="wandb"), run_dir=tmp_path / "run")
    cfg = tmp_path / "config.yaml"
    cfg.write_text("model:\n  n_layer: 2\n")
    tracker.log_artifact(cfg)
    tracker.log_params({"model.n_layer": 2})
    tracker.finish("success")
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    ours = run_dir / "files" / "gradloc-config.yaml"
    assert ours.read_text() == "model:\n  n_layer: 2\n"
    reserved = run_dir / "files" / "config.yaml"  # W&B's own run config, not overwritten by ours
    assert not reserved.exists() or "n_layer: 2\n" not in reserved.read_text().replace("value: 2", "")


NO_LOGIN = """
import sys
from gradloc_track.config import TrackerConfig
from gradloc_track.trackers import make_tracker

tracker = make_tracker(TrackerConfig(kind="wandb"), run_dir=sys.argv[1])
for step in range(5):
    tracker.log_metrics({"loss": 1.0}, step)
tracker.finish("success")
"""


def test_wandb_without_a_login_says_at_the_end_that_it_received_nothing_and_how_to_send_it(tmp_path):
    """The README's W&B command on a machine never logged in: one warning mid-run, every record to the
    spool, and the run ended as if all was well. The closing lines now say W&B received nothing, why,
    and the commands that send the records (login + replay; or offline mode + wandb sync)."""
    import os
    import subprocess
    import sys

    from ..conftest import ROOT

    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(HOME=str(home), WANDB_CONFIG_DIR=str(home / ".config" / "wandb"), NETRC=str(home / ".netrc"),
               WANDB_DIR=str(tmp_path), PYTHONPATH=str(ROOT))
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-c", NO_LOGIN, str(run)], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    tail = proc.stderr[proc.stderr.index("gradloc-track: W&B received NOTHING"):]
    assert "API key" in tail.splitlines()[0]
    assert f"6 record(s) are kept in {run / 'spool' / 'wandb.jsonl'}" in tail  # 5 steps and the final status
    assert "wandb login" in tail and f"gradloc-track replay {run}" in tail
    assert "WANDB_MODE=offline" in tail and "wandb sync" in tail
    assert len(read_spool(run / "spool" / "wandb.jsonl")) >= 5


def test_a_disabled_w_and_b_run_notes_nothing_and_warns_nothing(tmp_path, monkeypatch, recwarn):
    """Review, stop 64: under ``WANDB_MODE=disabled`` (W&B switched off, as in many CIs) the run has no files folder,
    and writing our notes there warned on every ``log_params``. An offline run does write them."""
    from gradloc_track.trackers.naming import RUN_FILE
    from gradloc_track.trackers.wandb_tracker import WandbTracker

    monkeypatch.chdir(tmp_path)
    off = WandbTracker(mode="disabled", run_dir=tmp_path / "off", same_run="abc")
    off.log_params({"spikes.enabled": False})
    off.finish("success")
    assert not [w for w in recwarn if RUN_FILE in str(w.message)]
    on = WandbTracker(mode="offline", dir=str(tmp_path), run_dir=tmp_path / "on", same_run="abc")
    on.log_params({"spikes.enabled": False})
    on.log_params({"clip.kind": "adagc"})
    files = on.run.dir
    on.finish("success")
    assert json.loads((tmp_path / files / RUN_FILE).read_text()) == {
        "same_run": "abc", "params": {"spikes.enabled": False, "clip.kind": "adagc"}}
