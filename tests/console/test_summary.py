"""The closing lines say what the blocks said, counted the same way, with the clipper's behaviour and the links."""
from __future__ import annotations

from types import SimpleNamespace

from gradloc_track.console import SpikeView, closing_lines, culprit_count, spike_summary, summary_lines
from gradloc_track.console.summary import OFF
from gradloc_track.localizer.result import LocateResult

from tests.artifacts.cases import levels_case

from .cases import EVENT, mlflow_record, mojibake_view, printed


def test_a_spike_that_was_not_localized_says_which_limit_and_links_no_page_that_does_not_exist(tmp_path):
    mlflow_record(tmp_path, "b" * 32)
    for why in ("locate.enabled=false", "locate.max_events=1 reached (raise it to localize more spikes)"):
        text = printed(SpikeView(100, [EVENT], not_localized=why), tmp_path)
        assert f"culprits   not localized: {why}" in text
        assert "highlight" not in text  # nothing was rendered: no link to a page that does not exist
        assert (f"/#/experiments/3/runs/{'b' * 32}/artifacts/spikes/events/step_000100.csv"
                "?workflowType=machine_learning") in text  # the event's row, a table in MLflow's UI
    # a caller that knows better (a TRL trainer whose loss is not rebuilt) overrides the monitor's reason
    stats = SimpleNamespace(step=100, events=[EVENT], locate=None, locate_view=None, surgery=None,
                            not_localized="no spike_context passed to after_backward")
    assert "not localized: DPOTrainer's loss is not rebuilt" in printed(
        stats, tmp_path, not_localized="DPOTrainer's loss is not rebuilt")
    lines = summary_lines(130, "adagc", {"seconds": 3.0, "final_loss": 4.5, "max_post_clip_grad_norm": 0.2},
                          [SpikeView(100, [EVENT], not_localized="locate.enabled=false")], tmp_path)
    assert "1 gradient spike(s) detected, at step 100" in lines
    assert "  step 100: not localized (locate.enabled=false)" in lines
    # the event's row again, once the run is surely open (a block printed before it was has no link)
    assert lines[lines.index("  step 100: not localized (locate.enabled=false)") + 1] == \
        f"    http://127.0.0.1:5000/#/experiments/3/runs/{'b' * 32}/artifacts/spikes/events/step_000100.csv" \
        "?workflowType=machine_learning"
    # comparing runs: the experiment's charts (every run overlaid), not the compare-runs page
    assert "  http://127.0.0.1:5000/#/experiments/3/runs?compareRunsMode=CHART&workflowType=machine_learning" \
        "    # every run of the experiment, charts overlaid" in lines


def test_the_summary_counts_what_the_block_named(tmp_path):
    """Never '0 culprit token(s)' after a block that named a whole sample: the summary's line is the
    block's first culprit line, counted by unit and level."""
    view = mojibake_view()
    block = printed(view, tmp_path)
    lines = spike_summary([view], tmp_path)
    assert lines[1] == "  step 100: 1 sample (3 tokens): sample 1, tokens 4-6: '\u00e2\u20ac\u2122'  (90% of the " \
                       "batch's squared grad norm)"
    assert lines[1].split(": ", 2)[2] in block
    events, result, ctx = levels_case()
    whole = SpikeView(12, events, result, ctx)
    assert culprit_count(whole) == "2 samples (1 whole, 2 tokens), 1 micro-batch"
    line = spike_summary([whole], tmp_path)[1]
    assert line.startswith("  step 12: 2 samples (1 whole, 2 tokens), 1 micro-batch: micro-batch 1, sample 1, "
                           "the whole sample: ") and "(60% of" in line and "0 culprit" not in line
    empty = SpikeView(5, [EVENT], LocateResult([], 3, "auto", 0.1, 1.0), ctx)
    assert spike_summary([empty], tmp_path)[1] == "  step 5: no culprit found (the spike is spread over the batch)"
    assert spike_summary([], tmp_path) == ["no gradient spike detected"]
    assert closing_lines("done: 5 steps", [], tmp_path)[:2] == ["done: 5 steps", "no gradient spike detected"]
    # a run without a detector was never checked: it does not read as a clean one (held-out tester, stop 63)
    assert spike_summary([], tmp_path, detecting=False) == [OFF]
    assert closing_lines("done: 5 steps", [], tmp_path, detecting=False)[1] == OFF and "spikes.enabled=false" in OFF
    # no spike: no report command (it would only answer "no spike events"; held-out tester round 3)
    assert not any("gradloc-track report" in line for line in closing_lines("done", [], tmp_path))
    assert any("gradloc-track report" in line for line in closing_lines("done", [empty], tmp_path))


def test_the_console_summary_reports_the_clip_after_warmup():
    base = {"seconds": 1.0, "final_loss": 2.0, "max_post_clip_grad_norm": 0.2}
    sat = {**base, "clip_steps_after_warmup": 80.0, "clip_clipped_fraction": 1.0, "clip_mean_coef": 0.29}
    ok = {**base, "clip_steps_after_warmup": 80.0, "clip_clipped_fraction": 0.3, "clip_mean_coef": 0.9}
    lines = summary_lines(130, "adagc", sat, [], "/tmp/run")
    assert ("clip=adagc after its warm-up: 100% of 80 steps clipped, mean coefficient 0.29 — a 3.4x learning-rate "
            "cut, not a spike guard") in lines
    assert "clip=adagc after its warm-up: 30% of 80 steps clipped, mean coefficient 0.90" in summary_lines(
        130, "adagc", ok, [], "/tmp/run")


def test_a_run_that_ends_inside_the_warm_up_says_so_not_a_largest_norm_of_0():
    short = {"seconds": 1.0, "final_loss": 2.0, "max_post_clip_grad_norm": float("nan")}
    lines = summary_lines(12, "adagc", short, [], "/tmp/run")
    # the transient is the detector's and the learning rate's warm-up, not the clipper's (whose line follows:
    # "after its warm-up"); the two read as one contradiction before (held-out tester round 8)
    assert ("clip=adagc: the run ended inside the start-up transient (the detector's and the learning rate's "
            "warm-up: no largest grad norm after it)") in lines
    assert not any("transient 0" in x or "nan" in x for x in lines)
    # without a spike detector there is no detector's warm-up to name (stop 63's note)
    off = summary_lines(12, "adagc", short, [], "/tmp/run", detecting=False)
    assert ("clip=adagc: the run ended inside the start-up transient (the first spikes.warmup_steps or "
            "optim.warmup_steps steps, whichever is longer: no largest grad norm after it)") in off
    assert not any("detector's" in x for x in off)


def test_a_run_with_no_tracker_run_and_no_spike_points_at_its_files_not_at_an_empty_header(tmp_path):
    """New-user tester round 12: ``tracker=none`` without a spike ended with "look at the results:" and nothing
    under it. Its run dir's own files are the results; with none of them there is no header."""
    assert closing_lines("done", [], tmp_path)[-1] == f"run dir: {tmp_path}"
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    lines = closing_lines("done", [], tmp_path)
    assert lines[-2:] == ["look at the results:",
                          f"  {tmp_path / 'metrics.jsonl'}    # every logged step, one JSON line each"]


def test_an_incidents_aftermath_is_counted_apart_and_not_listed(tmp_path):
    """A new user, stop 55: one bad batch closed with "2 gradient spike(s) detected, at step 170, 172" and step
    172 listed as "not localized (only the optimizer's update fired ...)", with no word of step 170."""
    first = SpikeView(170, [EVENT], not_localized="locate.enabled=false")
    later = SimpleNamespace(step=172, events=[EVENT], locate=None, locate_view=None, surgery=None,
                            not_localized="only the optimizer's update fired",
                            outcome=SimpleNamespace(cause=SimpleNamespace(aftermath_of=170)))
    assert SpikeView.of(later).aftermath_of == 170 and first.aftermath_of is None
    lines = spike_summary([first, later], tmp_path)
    assert lines[0] == "2 gradient spike(s) detected, at step 170, 172 (1 of them the aftermath of step 170)"
    # every one an aftermath (its incident before a resume): the header still says whose
    assert spike_summary([later], tmp_path)[0] == "1 gradient spike(s) detected, at step 172 (1 of them the " \
        "aftermath of step 170)"
    assert any(line.startswith("  step 170:") for line in lines) and not any("step 172:" in line for line in lines)
