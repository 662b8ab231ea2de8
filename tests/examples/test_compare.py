"""The comparison table (gradloc_track/demo/compare.py): clip_compare's table without its 60 spike blocks, the
verdict that calls a clipper scaling most clean steps a learning-rate cut, a multirun's rows from its job dirs."""
from __future__ import annotations

import json

from gradloc_track.demo.compare import comparison_table, sweep_rows, verdict

from .load import load_example

SMALL = ["train.steps=12", "train.batch_size=4", "train.seq_len=32", "model.n_layer=1", "model.d_model=32",
         "model.n_head=2", "model.max_seq_len=32", "train.num_threads=1", "train.inject.step=8",
         "train.inject.every=2", "spikes.warmup_steps=4", "optim.warmup_steps=2"]


def test_the_verdict_names_a_learning_rate_cut_a_guard_and_a_leak():
    assert verdict("none", {"spike_held": 5.0, "spike_clipped_fraction": 0.0}) == "no clipping"
    # clip_compare's AdaGC with its per-tensor defaults: every clean step cut to 0.35x
    assert verdict("adagc", {"clean_clipped_fraction": 1.0, "clean_mean_coef": 0.35, "spike_clipped_fraction": 1.0}) \
        == "learning-rate cut (2.9x)"
    # the demo's AdaGC-Global: its one spike scaled 2.07 -> 1.23, 1% of the clean steps
    assert verdict("adagc", {"clean_clipped_fraction": 0.01, "clean_mean_coef": 1.0, "spike_clipped_fraction": 1.0,
                             "spike_held": 1.51}) == "spike guard"
    # the demo's ZClip: the spike passed untouched
    assert verdict("zclip", {"clean_clipped_fraction": 0.0, "clean_mean_coef": 1.0, "spike_clipped_fraction": 0.0,
                             "spike_held": 2.43}) == "lets spikes through"
    assert verdict("zclip", {"clean_clipped_fraction": 0.0, "clean_mean_coef": 1.0}) == "-"  # nothing injected
    table = comparison_table([("clip=adagc", "adagc", {"events_at": [100], "spike_held": 1.1, "final_loss": 4.5,
                                                       "clean_clipped_fraction": 0.03, "clean_mean_coef": 0.99,
                                                       "spike_clipped_fraction": 1.0})])
    assert table.splitlines()[2] == "| clip=adagc | 1 | 100% | 1.10x | 3% | 0.99 | 4.5000 | spike guard |"


def test_clip_compare_prints_one_line_per_clipper_and_the_table_without_spike_blocks(tmp_path, capsys, monkeypatch):
    example = load_example("clip_compare")
    monkeypatch.setattr(example, "METHODS", ["none", "global"])
    results = example.run_all(SMALL, tmp_path)
    print(example.table(results))
    out, err = capsys.readouterr()
    assert "spike at step" not in out + err and "gradient spike(s) detected" not in out
    lines = out.splitlines()
    assert lines[0].startswith("clip=none: 12 steps in ") and lines[1].startswith("clip=global: 12 steps in ")
    assert lines[2].startswith("| run | spikes detected | spikes clipped") and lines[4].startswith("| clip=none | ")
    assert lines[4].endswith("| no clipping |") and lines[5].startswith("| clip=global | ")
    summary = json.loads((tmp_path / "global" / "summary.json").read_text())
    assert summary["spike_held"] > 0 and 0 <= summary["spike_clipped_fraction"] <= 1
    assert (tmp_path / "global" / "config.yaml").is_file()  # each run keeps its resolved config


def test_sweep_rows_label_each_job_by_what_the_sweep_swept(tmp_path):
    for n, clip in enumerate(["none", "adagc"]):
        job = tmp_path / f"{n}_clip={clip},train.steps=4"
        (job / ".hydra").mkdir(parents=True)
        (job / ".hydra" / "overrides.yaml").write_text(f"- clip={clip}\n- train.steps=4\n")
        (job / "config.yaml").write_text(f"clip:\n  kind: {clip}\n")
        (job / "summary.json").write_text(json.dumps({"final_loss": 5.0, "events_at": []}))
    rows = sweep_rows(tmp_path)
    assert [(label, kind) for label, kind, _ in rows] == [("clip=none", "none"), ("clip=adagc", "adagc")]
