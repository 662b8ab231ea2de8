"""Smoke runs of examples/train_lm.py as a user runs it: a subprocess with Hydra overrides."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from gradloc_track.artifacts import read_table

from ..conftest import new_mlflow_store
from .demo_run import demo_run, run_dirs, run_example
from .load import load_example

SMALL = ["train.steps=4", "train.batch_size=2", "train.seq_len=32", "model.n_layer=1", "model.d_model=32",
         "model.n_head=2", "model.max_seq_len=32", "train.num_threads=1"]


def mlflow_runs(tmp_path: Path):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.get_experiment_by_name("gradloc-track")
    return client, client.search_runs([exp.experiment_id])


def test_none_tracker_writes_local_files(tmp_path):
    run_example(tmp_path, "tracker=none", *SMALL)
    (run_dir,) = run_dirs(tmp_path)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(line)["step"] for line in lines]
    assert set(range(4)) <= set(steps)
    assert "grad_norm/global" in json.loads(lines[0])["metrics"]
    assert (run_dir / "config.yaml").exists()


def test_mlflow_tracker_logs_metrics_params_and_config(tmp_path):
    proc = run_example(tmp_path, "tracker=mlflow", *SMALL)
    client, runs = mlflow_runs(tmp_path)
    (run,) = runs
    assert run.info.status == "FINISHED"
    hist = client.get_metric_history(run.info.run_id, "grad_norm/global")
    assert sorted(m.step for m in hist) == [0, 1, 2, 3]
    assert run.data.params["train.steps"] == "4" and run.data.params["clip.kind"] == "none"
    assert "None" not in run.data.params.values()
    names = [a.path for a in client.list_artifacts(run.info.run_id)]
    assert any(n.endswith("config.yaml") for n in names)
    # metric noise: lr once (the monitor's, at the step it applied), constant weight decay once,
    # no AdamC ratio for plain AdamW, nothing after the last step, clip totals even with clip=none
    rid = run.info.run_id
    assert "train/lr" not in run.data.metrics and "adamc/steady_state_ratio" not in run.data.metrics
    assert sorted(m.step for m in client.get_metric_history(rid, "lr")) == [0, 1, 2, 3]
    assert [m.step for m in client.get_metric_history(rid, "weight_decay")] == [0]
    assert max(m.step for k in run.data.metrics for m in client.get_metric_history(rid, k)) == 3
    pre = {m.step: m.value for m in client.get_metric_history(rid, "clip/total_norm_pre")}
    post = {m.step: m.value for m in client.get_metric_history(rid, "clip/total_norm_post")}
    assert pre == post and sorted(pre) == [0, 1, 2, 3]
    # the console: progress lines, a summary in words, the exact commands to look at the run
    out = proc.stdout + proc.stderr
    (run_dir,) = run_dirs(tmp_path)
    assert "[4/4] step 3  loss" in out and "done: 4 steps" in out and "no gradient spike detected" in out
    assert "'final_loss'" not in out  # no raw dict
    assert "MLflow database tables" not in out  # a new store is MLflow's bookkeeping, not news for the user
    assert f"/#/experiments/{run.info.experiment_id}/runs/{rid}" in out
    assert f"mlflow ui --backend-store-uri sqlite:///{tmp_path / 'mlflow.db'}" in out
    assert f"gradloc-track report {run_dir}" not in out  # no spike: a report would only say so


def test_bad_override_fails_with_a_clear_message_once_and_leaves_no_run_dir(tmp_path):
    proc = run_example(tmp_path, "monitor.log_every=-1", *SMALL, check=False)
    assert proc.returncode != 0
    assert "monitor.log_every" in proc.stderr and "positive integer" in proc.stderr
    assert (proc.stdout + proc.stderr).count("monitor.log_every=-1") == 1
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_a_renamed_clip_key_fails_naming_the_new_one_and_leaves_no_run_dir(tmp_path):
    proc = run_example(tmp_path, "clip=layerclip", "clip.layer_alpha=0.9", *SMALL, check=False)
    assert proc.returncode != 0
    assert "clip.layer_alpha (renamed: use clip.alpha with clip=layerclip)" in proc.stderr
    assert not (tmp_path / "runs").exists()


def test_a_key_typo_without_plus_gets_did_you_mean_and_leaves_no_run_dir(tmp_path):
    proc = run_example(tmp_path, "monitor.log_evry=5", *SMALL, check=False)
    assert proc.returncode != 0
    assert "monitor.log_evry (did you mean monitor.log_every?)" in proc.stderr
    assert "Could not override" not in proc.stderr  # ours, before Hydra's (which has no suggestion)
    assert not (tmp_path / "runs").exists()


def test_multirun_gives_one_tracker_run_per_job(tmp_path):
    """Also, from a held-out tester (stop 55): an experiment in the user's own ``--config-dir`` is an option
    (it was refused as "no such option"), and a job's folder name stays short whatever its overrides (18
    overrides, 300 characters: "File name too long" before any job ran)."""
    new_mlflow_store(tmp_path / "mlflow.db")  # run_example's store (a new store's console: the mlflow test above)
    (tmp_path / "conf" / "experiment").mkdir(parents=True)
    (tmp_path / "conf" / "experiment" / "mine.yaml").write_text("# @package _global_\ntrain:\n  seed: 0\n")
    long = "train.inject.text=" + "x" * 200  # no injection step: a value that only lengthens the overrides
    proc = run_example(tmp_path, "-m", f"--config-dir={tmp_path / 'conf'}", "experiment=mine", "tracker=mlflow",
                       "clip=none,adagc", long, *SMALL)
    # the sweep ends with one table of its jobs, labelled by what it swept, after every job's own summary
    table = proc.stdout[proc.stdout.index("the sweep: 2 job(s), run dirs under "):]
    assert "| clip=none | 0 |" in table and "| clip=adagc | 0 |" in table and "done: 4 steps" not in table
    _, runs = mlflow_runs(tmp_path)
    assert len(runs) == 2
    names = sorted(r.info.run_name for r in runs)
    # only the swept override (not every override), the seed and the start time
    assert [re.sub(r"\d\d-\d\d \d\d:\d\d:\d\d$", "<time>", n) for n in names] == \
        ["clip=adagc seed=0 <time>", "clip=none seed=0 <time>"]
    assert {r.data.params["clip.kind"] for r in runs} == {"none", "adagc"}
    (sweep,) = (tmp_path / "runs" / "multirun").iterdir()
    jobs = sorted(p.name for p in sweep.iterdir() if p.is_dir())
    assert [j[:8] for j in jobs] == ["0_clip=n", "1_clip=a"] and all(len(j) <= 102 and "~" in j for j in jobs)


@pytest.mark.slow
def test_spike_demo_detects_and_localizes_the_injected_answer(tmp_path_factory, tmp_path):
    """The full demo (the README's command, with ``tracker=both``: both trackers from one run, W&B offline):
    detection at the injected step, culprits = the mojibake answer, artifacts in MLflow and W&B, a clipper
    that clips the spike and almost nothing else, a console that names the text and the run, and a report
    from the printed run dir."""
    demo = demo_run(tmp_path_factory)
    run_dir = demo.run_dir
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["events_at"] == [100]
    client, (run,) = mlflow_runs(demo.root)
    assert int(run.data.tags["spike_count"]) >= 1
    local = Path(client.download_artifacts(run.info.run_id, "spikes", str(tmp_path / "dl")))
    table = read_table(local.parent, "spikes/tokens")
    cols = table["columns"]
    rows = [dict(zip(cols, r)) for r in table["data"] if dict(zip(cols, r))["step"] == 100]
    assert {(r["sample"], r["position"]) for r in rows} == {(3, 40), (3, 41), (3, 42)}
    assert "".join(r["token"] for r in sorted(rows, key=lambda r: r["position"])) == "\u00e2\u20ac\u2122"
    html = (local / "highlight" / "step_000100.html").read_text()
    for r in rows:
        assert r["token"] in html
    assert "<script" not in html.lower()
    assert "clipped in place" not in html  # the localizer's step check knows what the clipper did
    # AdaGC clipped the spike, and few other steps after its warm-up: a spike guard, not a learning-rate cut
    pre = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "clip/total_norm_pre")}
    post = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "clip/total_norm_post")}
    assert post[100] < 0.8 * pre[100]
    assert summary["clip_clipped_fraction"] < 0.1 and summary["clip_mean_coef"] > 0.95
    assert any(k.startswith("clip/threshold/") for k in run.data.metrics)
    # the console: one spike block with the culprit text and the run link, a summary with commands, no warning
    # that the clipper cut the learning rate
    out = demo.console
    assert out.count("spike at step 100") == 1 and "tokens 40-42: '\u00e2\u20ac\u2122'" in out
    assert f"/#/experiments/{run.info.experiment_id}/runs/{run.info.run_id}" in out
    assert "1 gradient spike(s) detected, at step 100" in out
    assert "  step 100: 1 sample (3 tokens): sample 3, tokens 40-42" in out
    assert "learning-rate cut" not in out and "UserWarning" not in out
    assert re.search(r"MLflow run spike_demo clip=adagc seed=0 \d\d-\d\d \d\d:\d\d:\d\d \(", out)
    # the same event in the offline W&B run: table rows and highlighted html
    (wrun,) = demo.root.rglob("offline-run-*")
    tables = [json.loads(p.read_text()) for p in (wrun / "files" / "media" / "table").rglob("*.table.json")]

    def wb_rows(t):
        c = t["columns"]
        return {(r[c.index("sample")], r[c.index("position")]) for r in t["data"] if r[c.index("step")] == 100}

    # the culprit table (the run also holds spikes/events, whose rows have no sample)
    assert any(wb_rows(t) == {(3, 40), (3, 41), (3, 42)} for t in tables if "sample" in t["columns"])
    pages = [p.read_text() for p in (wrun / "files" / "media" / "html").rglob("*.html")]
    assert any(rows[0]["token"] in p for p in pages)
    # gradloc-track report on the run dir the app printed follows it to the MLflow run
    from gradloc_track.cli import main

    assert main(["report", str(run_dir), "-o", str(tmp_path / "report.html")]) == 0
    page = (tmp_path / "report.html").read_text(encoding="utf-8")
    assert "<title>spike_demo clip=adagc seed=0 " in page and "(steps 100)" in page


def test_detection_without_localization_is_counted_shown_and_reported(tmp_path):
    """locate.enabled=false: the spike is the run's spike_count, the block says why it was not localized
    and links no page that does not exist, and the report lists it (a small model: the same spike fires). At this
    size the garbled span moves only the position embedding's norm, 1.8x at z 8: the run sets spikes.z_thresh=6 (the
    default before stop 59; at 8 x its tail correction the step stays under the bar)."""
    new_mlflow_store(tmp_path / "mlflow.db")  # run_example's store
    proc = run_example(tmp_path, "experiment=spike_demo", "locate.enabled=false", "tracker=mlflow", "train.steps=101",
                       "model.n_layer=1", "model.d_model=32", "model.n_head=2", "train.num_threads=1",
                       "spikes.z_thresh=6")
    (run_dir,) = run_dirs(tmp_path)
    assert json.loads((run_dir / "summary.json").read_text())["events_at"] == [100]
    client, (run,) = mlflow_runs(tmp_path)
    assert run.data.tags["spike_count"] == "1" and run.data.metrics["spike_count"] == 1.0
    out = proc.stdout + proc.stderr
    assert "not localized: locate.enabled=false" in out and "highlight/" not in out
    assert f"runs/{run.info.run_id}/artifacts/spikes/events/step_000100.csv" in out
    names = {p.path for p in client.list_artifacts(run.info.run_id, "spikes/events")}
    assert names == {"spikes/events/step_000100.csv", "spikes/events/step_000100.json"}  # the link is alive
    from gradloc_track.cli import main

    assert main(["report", str(run_dir), "-o", str(tmp_path / "report.html")]) == 0
    page = (tmp_path / "report.html").read_text(encoding="utf-8")
    assert "1 spike event(s) (steps 100)" in page and "Not localized: locate.enabled=false" in page


def test_a_run_is_named_by_experiment_clipper_seed_and_time_unless_the_user_named_it():
    from gradloc_track.config import to_config
    from hydra import compose, initialize_config_dir

    job_run_name = load_example("train_lm").job_run_name
    from ..conftest import CONF_DIR

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = to_config(compose("config", overrides=["experiment=spike_demo", "train.seed=3"]))
    name = job_run_name(cfg, ["experiment=spike_demo", "train.seed=3"], ["experiment=spike_demo"], False)
    assert re.fullmatch(r"spike_demo clip=adagc seed=3 \d\d-\d\d \d\d:\d\d:\d\d", name), name
    cfg.run_name = "mine"
    assert job_run_name(cfg, ["run_name=mine"], ["run_name=mine"], False) == "mine"  # the user's choice, as given
    swept = job_run_name(cfg, ["clip=adagc", "train.seed=3"], ["-m", "clip=none,adagc", "train.seed=3"], True)
    assert swept.startswith("mine[clip=adagc] seed=3 ")


def test_swept_run_name_keeps_only_swept_overrides():
    swept_run_name = load_example("train_lm").swept_run_name
    argv = ["-m", "experiment=spike_demo", "clip=none,adagc", "train.steps=4", "out_dir=/tmp/x"]
    job = ["experiment=spike_demo", "clip=adagc", "train.steps=4", "out_dir=/tmp/x"]
    assert swept_run_name("spike_demo", job, argv) == "spike_demo[clip=adagc]"
    assert swept_run_name(None, job, argv) == "clip=adagc"


def test_locate_false_fails_in_one_line_naming_locate_enabled(tmp_path):
    proc = run_example(tmp_path, "locate=false", *SMALL, check=False)
    assert proc.returncode != 0 and "use locate.enabled=false" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "runs").exists()


def test_the_spike_pause_is_the_spike_step_and_what_the_steps_after_it_still_lose_in_normal_steps():
    """Issue 38 item 4: the demo prints how long a spike held training up, in normal steps (the median of
    the steps either side), so the goal (localizing with P probes costs at most P + 1) reads off the run."""
    spike_pause = load_example("train_lm").spike_pause
    steps = [0.2] * 10 + [1.2] + [0.3, 0.25] + [0.2] * 8  # a 6-step spike, then two slowed steps
    pause, after = spike_pause(steps, 10)
    assert after == pytest.approx(0.75) and pause == pytest.approx(6.75)
    drifted = [0.2] * 10 + [1.2] + [0.3] * 10  # the machine got slower at the spike: the pace is the later one
    assert spike_pause(drifted, 10)[0] == pytest.approx(1.2 / 0.3)
    assert spike_pause(steps, 3) is None  # no 10 steps before it to tell the pace


def test_a_tracker_whose_extra_is_missing_fails_in_one_line_naming_the_extra(tmp_path, monkeypatch):
    """New-user tester round 12: tracker=wandb without wandb printed Hydra's "Error executing job" and a
    40-line traceback, the pip line near its end. (wandb is kept from importing by a stub on the path.)"""
    stub = tmp_path / "stub" / "wandb"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text("raise ImportError('blocked for the test', name='wandb')\n")
    monkeypatch.setenv("PYTHONPATH", str(stub.parent))
    proc = run_example(tmp_path, "tracker=wandb", *SMALL, check=False)
    assert proc.returncode != 0
    assert "error: 'wandb' is not installed" in proc.stderr and "pip install 'gradloc-track[wandb]'" in proc.stderr
    assert "Traceback" not in proc.stderr and "Error executing job" not in proc.stderr, proc.stderr[-2000:]
