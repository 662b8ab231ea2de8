"""The demo's console: the spike block names the text (at every culprit level) and where to look; the
summary; a plain log when not a tty."""
from __future__ import annotations

import io
import json

import torch

from gradloc_track.console import TrainConsole, culprit_spans, summary_lines, view_commands, where_to_look
from gradloc_track.demo.data import ByteTokenizer
from gradloc_track.localizer.result import CulpritToken, LocateResult
from gradloc_track.spikes.event import SpikeEvent
from gradloc_track.trackers.run_record import read_run_views, record_run

from tests.artifacts.cases import T_LEVELS, levels_case


def test_spike_block_names_text_and_where_to_look(tmp_path):
    record_run(tmp_path, "mlflow", {"tracking_uri": "sqlite:////data/mlflow.db", "experiment_id": "3",
                                    "run_id": "a" * 32, "run_name": "spike_demo"})
    record_run(tmp_path, "wandb", {"dir": "/w/offline-run-1", "path": "me/proj/xyz", "offline": True})
    assert set(read_run_views(tmp_path)) == {"mlflow", "wandb"}  # merged, not overwritten
    ids = torch.zeros(4, 10, dtype=torch.long)
    ids[1, 4:7] = torch.tensor([1, 2, 3])
    toks = [CulpritToken(1, p, grad_norm=1.0, score=1.0, share=0.3, layer_norms={}) for p in (4, 5, 6)]
    result = LocateResult(toks, probes=5, method="bisect", threshold=0.1, total_norm=2.0)

    class Tok:
        def decode(self, i):
            return {1: "\u00e2", 2: "\u20ac", 3: "\u2122"}.get(int(i[0]), "?")

    out = io.StringIO()
    con = TrainConsole(stream=out)
    con.spike(100, [SpikeEvent(100, "global", 2.2, 0.7, 40.0, 3.2)], result, Tok(), ids, tmp_path)
    text = out.getvalue()
    assert "spike at step 100" in text and "3.2x its running mean" in text
    assert "sample 1, positions 4-6: '\u00e2\u20ac\u2122'  (90% of the batch's squared grad norm)" in text
    assert (f"http://127.0.0.1:5000/#/experiments/3/runs/{'a' * 32}/artifacts/spikes/highlight/step_000100.html"
            "?workflowType=machine_learning") in text  # opens in the model-training view
    assert "W&B run me/proj/xyz" in text
    cmds = "\n".join(view_commands(tmp_path))
    assert "mlflow ui --backend-store-uri sqlite:////data/mlflow.db --port 5000" in cmds
    assert "wandb sync /w/offline-run-1" in cmds and f"gradloc-track report {tmp_path}" in cmds
    assert where_to_look(tmp_path / "nothing") == [f"run dir: {tmp_path / 'nothing'}"]
    assert culprit_spans(LocateResult([], 1, "bisect", 0.1, 1.0), str) == []


def test_plain_console_prints_a_tenth_of_the_steps_when_not_a_tty():
    out = io.StringIO()
    con = TrainConsole(stream=out)
    con.start(100)
    for s in range(100):
        con.step(s, 2.0, 0.5)
    con.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 11 and lines[-1] == "step 100/100  loss 2.000  grad norm 0.5"
    json.dumps(lines)


def test_a_spike_that_was_not_localized_says_which_limit_and_links_no_page_that_does_not_exist(tmp_path):
    record_run(tmp_path, "mlflow", {"tracking_uri": "sqlite:////data/mlflow.db", "experiment_id": "3",
                                    "run_id": "b" * 32, "run_name": "spike_demo"})
    ids = torch.zeros(4, 10, dtype=torch.long)
    for why in ("locate.enabled=false", "locate.max_events=1 reached (raise it to localize more spikes)"):
        out = io.StringIO()
        TrainConsole(stream=out).spike(100, [SpikeEvent(100, "global", 2.2, 0.7, 40.0, 3.2)], None, None, ids,
                                       tmp_path, not_localized=why)
        text = out.getvalue()
        assert f"culprits   not localized: {why}" in text
        assert "highlight" not in text  # nothing was rendered: no link to a page that does not exist
        assert (f"/#/experiments/3/runs/{'b' * 32}/artifacts/spikes/events/step_000100.csv"
                "?workflowType=machine_learning") in text  # the event's row, a table in MLflow's UI
    lines = summary_lines(130, "adagc", {"seconds": 3.0, "final_loss": 4.5, "max_post_clip_grad_norm": 0.2}, [100],
                          {}, tmp_path, {100: "locate.enabled=false"})
    assert "1 gradient spike(s) detected, at step 100" in lines
    assert "  step 100: not localized (locate.enabled=false)" in lines
    # the event's row again, once the run is surely open (a block printed before it opened has no link)
    assert lines[lines.index("  step 100: not localized (locate.enabled=false)") + 1] == \
        f"    http://127.0.0.1:5000/#/experiments/3/runs/{'b' * 32}/artifacts/spikes/events/step_000100.csv" \
        "?workflowType=machine_learning"
    # comparing runs: the experiment's charts (every run overlaid), not the compare-runs page
    assert "  http://127.0.0.1:5000/#/experiments/3/runs?compareRunsMode=CHART&workflowType=machine_learning" \
        "    # every run of the experiment, charts overlaid" in lines


def test_the_console_summary_reports_the_clip_after_warmup():
    from gradloc_track.console import summary_lines

    base = {"seconds": 1.0, "final_loss": 2.0, "max_post_clip_grad_norm": 0.2}
    sat = {**base, "clip_steps_after_warmup": 80.0, "clip_clipped_fraction": 1.0, "clip_mean_coef": 0.29}
    ok = {**base, "clip_steps_after_warmup": 80.0, "clip_clipped_fraction": 0.3, "clip_mean_coef": 0.9}
    lines = summary_lines(130, "adagc", sat, [100], {}, "/tmp/run")
    assert "clip=adagc after warm-up: 100% of 80 steps clipped, mean coefficient 0.29 — a 3.4x learning-rate cut, " \
           "not a spike guard" in lines
    assert "clip=adagc after warm-up: 30% of 80 steps clipped, mean coefficient 0.90" in summary_lines(
        130, "adagc", ok, [], {}, "/tmp/run")


def test_console_block_names_the_sample_and_the_micro_batch(tmp_path):
    events, result, ctx = levels_case()
    out = io.StringIO()
    TrainConsole(stream=out).spike(12, events, result, ByteTokenizer(), ctx.input_ids, tmp_path)
    text = out.getvalue()
    assert "micro-batch 1, sample 1, the whole sample: '<b>garbage & more</b>" in text and "(60% of" in text
    assert "micro-batch 2: the whole micro-batch (no sample or token in it stands out)" in text
    assert "micro-batch 0, sample 0, positions 4-5" in text


def test_console_block_without_culprits_gives_the_per_sample_shares(tmp_path):
    result = LocateResult([], probes=6, method="auto", threshold=0.3, total_norm=3.0,
                          sample_shares=[{"micro_batch": None, "sample": 3, "document": None, "share": 0.21,
                                          "grad_norm": 1.0}])
    out = io.StringIO()
    TrainConsole(stream=out).spike(12, [], result, None, torch.zeros(4, T_LEVELS, dtype=torch.long), tmp_path)
    assert "none found: no sample, span or token stands out" in out.getvalue()
    assert "largest per-sample shares: sample 3 21%" in out.getvalue()
