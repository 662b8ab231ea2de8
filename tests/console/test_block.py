"""The spike block: the signal, the culprits, surgery, where to look; or why nothing was localized."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from gradloc_track.console import SpikeView, culprit_lines
from gradloc_track.localizer.result import CulpritToken, LocateResult
from gradloc_track.localizer.surgery import SurgeryResult
from gradloc_track.spikes import SpikeContext
from gradloc_track.trackers.run_record import read_run_views, record_run

from tests.artifacts.cases import T_LEVELS

from .cases import EVENT, mlflow_record, mojibake_view, printed


def test_spike_block_names_text_and_where_to_look(tmp_path):
    mlflow_record(tmp_path, "a" * 32)
    record_run(tmp_path, "wandb", {"dir": "/w/offline-run-1", "path": "me/proj/xyz", "offline": True})
    assert set(read_run_views(tmp_path)) == {"mlflow", "wandb"}  # merged, not overwritten
    text = printed(mojibake_view(), tmp_path)
    assert "spike at step 100" in text and "3.2x its running mean" in text
    assert "sample 1, tokens 4-6: '\u00e2\u20ac\u2122'  (90% of the batch's squared grad norm)" in text
    assert (f"http://127.0.0.1:5000/#/experiments/3/runs/{'a' * 32}/artifacts/spikes/highlight/step_000100.html"
            "?workflowType=machine_learning") in text  # opens in the model-training view
    assert "W&B run me/proj/xyz" in text  # the commands and the places themselves: tests/console/test_links.py
    assert culprit_lines(SpikeView(1, [], LocateResult([], 1, "bisect", 0.1, 1.0))) == []


def test_a_gradstats_is_shown_through_its_locate_view(tmp_path):
    """``console.spike(stats, run_dir)``: the result and the context come from ``stats.locate_view``."""
    v = mojibake_view()
    stats = SimpleNamespace(step=100, events=[EVENT], locate=v.result, locate_view=(v.result, v.context),
                            not_localized=None, surgery=None)
    assert "sample 1, tokens 4-6: '\u00e2\u20ac\u2122'" in printed(stats, tmp_path)


def test_surgery_and_many_culprits_in_one_block(tmp_path):
    view = mojibake_view()
    view.surgery = SurgeryResult(True, "", removed_share=0.9, culprits=1, grad_norm_pre=5.61, grad_norm_post=1.55)
    view.result.tokens = [CulpritToken(b, 4, grad_norm=1.0, share=0.1) for b in range(4)] + \
        [CulpritToken(b, 8, grad_norm=1.0, share=0.05) for b in range(4)]
    view.result.culprits = list(view.result.tokens)
    text = printed(view, tmp_path)
    assert "surgery    removed 90% of the step's squared grad norm (1 culprit row(s), one probe): grad norm 5.61 " \
           "-> 1.55, then to the clipper" in text
    assert "... and 3 more culprit row(s) (spikes/tokens lists them all)" in text


def test_console_block_without_culprits_gives_the_per_sample_shares(tmp_path):
    result = LocateResult([], probes=6, method="auto", threshold=0.3, total_norm=3.0,
                          sample_shares=[{"micro_batch": None, "sample": 3, "document": None, "share": 0.21,
                                          "grad_norm": 1.0}])
    ctx = SpikeContext(lambda m: m.sum(), torch.ones(4, T_LEVELS), input_ids=torch.zeros(4, T_LEVELS, dtype=torch.long))
    text = printed(SpikeView(12, [], result, ctx), tmp_path)
    assert "none found: no sample, span or token stands out" in text
    assert "largest per-sample shares: sample 3 21%" in text
    # held-out tester, stop 54: a NaN multiplier on one rank's loss; the finite replay's shares read as the step's
    from gradloc_track.localizer.result import StepCheck

    result.step_check = StepCheck(residual=1.0, norm_ratio=float("nan"), replayed=False, reason="...")
    assert "largest per-sample shares of the replayed step: sample 3 21%" in printed(SpikeView(12, [], result, ctx),
                                                                                    tmp_path)


def test_a_non_finite_step_says_which_sample_and_a_sum_overflow_names_none(tmp_path):
    from gradloc_track.localizer.nonfinite import NonfiniteFinding, NonfiniteSample, culprit_rows

    ids = torch.zeros(4, T_LEVELS, dtype=torch.long)
    ctx = SpikeContext(lambda m: m.sum(), torch.ones(4, T_LEVELS), input_ids=ids)
    nan = NonfiniteFinding("samples", (3,), ((3, 5),), "sample 3's loss is Inf (token 5): its gradient is NaN",
                           (NonfiniteSample(3, loss=float("inf"), terms=(5,), n_terms=T_LEVELS),))
    rows = culprit_rows(nan)
    result = LocateResult(rows, probes=5, method="auto", threshold=float("nan"), total_norm=float("nan"),
                          culprits=rows, nonfinite=nan)
    text = printed(SpikeView(7, [], result, ctx), tmp_path)
    assert "non-finite sample 3's loss is Inf (token 5): its gradient is NaN" in text
    assert "sample 3, token 5: '<0>'  (its gradient is non-finite)" in text and "% of the batch" not in text
    total = NonfiniteFinding("sum", detail="the sum overflows, not one sample")
    text = printed(SpikeView(8, [], LocateResult([], 20, "auto", float("nan"), float("inf"), nonfinite=total), ctx),
                   tmp_path)
    assert "non-finite the sum overflows, not one sample" in text and "none found" not in text


def test_the_block_says_the_cause_in_words(tmp_path):
    import dataclasses

    view = mojibake_view()
    detail = "the learning rate rose 10x at this step (0.001 -> 0.01): the update grows with it, whatever the data"
    view.events = [dataclasses.replace(EVENT, cause="schedule", cause_detail=detail)]
    text = printed(view, tmp_path)
    assert f"  cause      schedule: {detail}" in text
    assert "cause " not in printed(mojibake_view(), tmp_path)  # no cause named: no line


def test_a_view_without_token_ids_links_the_events_row_not_a_page_never_written(tmp_path):
    """Under torch.distributed rank 0's gathered view holds the culprits' rows only: with none found there are
    no ids, so no highlight page is written (held-out tester round 3: the block linked one anyway)."""
    mlflow_record(tmp_path, "a" * 32)
    result = LocateResult([], probes=6, method="auto", threshold=0.3, total_norm=3.0)
    text = printed(SpikeView(12, [EVENT], result, SimpleNamespace(input_ids=None)), tmp_path)
    assert "spikes/events/step_000012.csv" in text and "highlight" not in text
    assert "spikes/highlight/step_000100.html" in printed(mojibake_view(), tmp_path)


def test_a_long_whole_sample_shows_its_hottest_text_not_its_clean_start(tmp_path):
    """A whole sample of 32 terms whose bad text is at positions 10-25: the line shows the text around the
    term the ghost pass rated highest, after an ellipsis (before: its first 40 characters, clean text)."""
    from gradloc_track.localizer.result import Culprit

    class Words:
        def decode(self, ids):
            return "".join("X" if int(i) == 9 else f" w{int(i)}" for i in ids)

    ids = torch.arange(32).repeat(2, 1) + 10
    ids[1, 10:26] = 9
    ghost = torch.full((2, 32), 0.01)
    ghost[1, 10:26] = 1.0
    ghost[1, 18] = 2.0
    result = LocateResult([], probes=6, method="auto", threshold=0.3, total_norm=3.0, ghost_map=ghost)
    result.culprits = [Culprit("sample", 2.0, share=0.95, batch=1, start=0, end=32, n_terms=32)]
    ctx = SpikeContext(lambda m: m.sum(), torch.ones(2, 32), input_ids=ids, tokenizer=Words())
    line = next(ln for ln in printed(SpikeView(7, [EVENT], result, ctx), tmp_path).splitlines() if "sample 1" in ln)
    assert "the whole sample: '\u2026XXXXXXXXXXX w36" in line, line  # from just before the hottest term (18)


def test_a_later_step_of_an_incident_is_one_line(tmp_path):
    """Held-out tester, stop 52: a corrupt weight printed a full block on each of 150 skipped steps (1,050
    lines); an lr jump's recovery one per step. The incident's own block says it all; each later step that
    was not localized is one line (its row of spikes/events keeps the rest)."""
    import dataclasses

    detail = ("aftermath of step 150 (numeric): a weight is absurd: h.1.mlp.fc.weight[3, 5] = 1e+36 (...); "
              "stop the run and roll back to a checkpoint saved before step 150")
    later = dataclasses.replace(EVENT, step=151, cause="numeric", cause_detail=detail)
    (tmp_path / "spikes").mkdir()  # a kept run dir holding the events' files
    text = printed(SpikeView(151, [later], not_localized="a weight is corrupt since step 150 (h.1.mlp.fc.weight): "
                                                        "the batch is not the cause"), tmp_path)
    assert text.strip().splitlines() == ["── spike at step 151: aftermath of step 150 (numeric), grad_norm/global = "
                                         f"2.2; not localized (its row of spikes/events in {tmp_path})"]
    first = dataclasses.replace(EVENT, step=150, cause="numeric", cause_detail=detail.split(": ", 1)[1])
    assert len(printed(SpikeView(150, [first], not_localized="a weight is corrupt since step 150 (h.1.mlp.fc."
                                                             "weight): the batch is not the cause"),
                       tmp_path).strip().splitlines()) > 2  # the incident's own step: the whole block


def test_a_later_steps_line_names_no_file_a_scratch_run_dir_loses_and_links_a_backends_row(tmp_path):
    """Held-out tester, stop 54: without a run dir (a scratch one, removed at the end) the one line named
    'spikes/events/step_000032.csv', a file never kept, while the full blocks said 'no run dir'. Now it names
    the backend's link to the row, else nothing."""
    import dataclasses

    from gradloc_track.trackers.join import RunDir

    later = dataclasses.replace(EVENT, step=32, cause="data", cause_detail="aftermath of step 30 (data): ...")
    scratch = RunDir(None)
    try:
        line = printed(SpikeView(32, [later], not_localized="aftermath"), scratch.path).strip()
        assert line == "── spike at step 32: aftermath of step 30 (data), grad_norm/global = 2.2; not localized", line
        mlflow_record(scratch.path, "a" * 32)
        line = printed(SpikeView(32, [later], not_localized="aftermath"), scratch.path).strip()
        assert "(http://" in line and "artifacts/spikes/events/step_000032.csv" in line, line
    finally:
        scratch.remove()


def test_the_block_lists_the_strongest_signals_and_names_what_it_leaves_out(tmp_path):
    """Held-out tester, stop 57: listed as the detector found them, three layers at z 9-12 filled the block and the
    step's largest-sample loss (z 18) and batch loss (z 15) went under "... and 3 more layer(s)". The step's lead
    signal (the layer furthest out here: no global norm fired) comes first, then the strongest; what is left out is
    counted as layers and signals, by name."""
    from gradloc_track.spikes.event import SpikeEvent

    rows = [("model.norm", 12.0), ("model.layers.1", 10.0), ("lm_head", 9.0), ("sample_loss", 18.0), ("loss", 15.0),
            ("junk_span", 9.0)]  # (signal, z) as the detector lists them: layers first
    events = [SpikeEvent(121, signal, 3.0, 1.0, z, 3.0) for signal, z in rows]
    view = mojibake_view(121)
    view.events = events
    signals = [ln for ln in printed(view, tmp_path).splitlines() if ln.startswith("  signal")]
    assert [ln.split()[1] for ln in signals] == ["grad_norm/model.norm", "loss/sample_max", "loss"]
    assert "... and 2 more layer(s), 1 more signal(s) (loss/junk_span)" in printed(view, tmp_path)
