"""The one console: the spike block names the text, level and share of each culprit (a sample, an RL
completion by group and reward, a packed document) and where to look, or why nothing was localized;
the summary says what the blocks said; a plain log when not a tty."""
from __future__ import annotations

import io
import json
from types import SimpleNamespace

import torch

from gradloc_track.console import (SpikeView, TrainConsole, closing_lines, culprit_count, culprit_lines,
                                   spike_summary, summary_lines, view_commands, where_to_look)
from gradloc_track.demo.data import ByteTokenizer
from gradloc_track.localizer.result import Culprit, CulpritToken, LocateResult
from gradloc_track.localizer.surgery import SurgeryResult
from gradloc_track.spikes import SpikeContext
from gradloc_track.spikes.event import SpikeEvent
from gradloc_track.trackers.run_record import read_run_views, record_run

from tests.artifacts.cases import T_LEVELS, levels_case

EVENT = SpikeEvent(100, "global", 2.2, 0.7, 40.0, 3.2)


class Tok:
    def decode(self, i):
        return {1: "\u00e2", 2: "\u20ac", 3: "\u2122"}.get(int(i[0]), "?")


def mojibake_view(step: int = 100) -> SpikeView:
    """Sample 1's tokens 4-6 ('â€™') carry 90% of the step."""
    ids = torch.zeros(4, 10, dtype=torch.long)
    ids[1, 4:7] = torch.tensor([1, 2, 3])
    toks = [CulpritToken(1, p, grad_norm=1.0, score=1.0, share=0.3, layer_norms={}) for p in (4, 5, 6)]
    result = LocateResult(toks, probes=5, method="bisect", threshold=0.1, total_norm=2.0)
    ctx = SpikeContext(lambda m: m.sum(), torch.ones(4, 10), input_ids=ids, tokenizer=Tok())
    return SpikeView(step, [EVENT], result, ctx)


def mlflow_record(run_dir, run_id: str) -> None:
    record_run(run_dir, "mlflow", {"tracking_uri": "sqlite:////data/mlflow.db", "experiment_id": "3",
                                   "run_id": run_id, "run_name": "spike_demo"})


def printed(view, run_dir, **kw) -> str:
    out = io.StringIO()
    TrainConsole(stream=out).spike(view, run_dir, **kw)
    return out.getvalue()


def test_spike_block_names_text_and_where_to_look(tmp_path):
    mlflow_record(tmp_path, "a" * 32)
    record_run(tmp_path, "wandb", {"dir": "/w/offline-run-1", "path": "me/proj/xyz", "offline": True})
    assert set(read_run_views(tmp_path)) == {"mlflow", "wandb"}  # merged, not overwritten
    text = printed(mojibake_view(), tmp_path)
    assert "spike at step 100" in text and "3.2x its running mean" in text
    assert "sample 1, tokens 4-6: '\u00e2\u20ac\u2122'  (90% of the batch's squared grad norm)" in text
    assert (f"http://127.0.0.1:5000/#/experiments/3/runs/{'a' * 32}/artifacts/spikes/highlight/step_000100.html"
            "?workflowType=machine_learning") in text  # opens in the model-training view
    assert "W&B run me/proj/xyz" in text
    cmds = "\n".join(view_commands(tmp_path))
    assert "mlflow ui --backend-store-uri sqlite:////data/mlflow.db --port 5000" in cmds
    assert "wandb sync /w/offline-run-1" in cmds and f"gradloc-track report {tmp_path}" in cmds
    assert where_to_look(tmp_path / "nothing") == [f"run dir: {tmp_path / 'nothing'}"]
    assert culprit_lines(SpikeView(1, [], LocateResult([], 1, "bisect", 0.1, 1.0))) == []


def test_a_gradstats_is_shown_through_its_locate_view(tmp_path):
    """``console.spike(stats, run_dir)``: the result and the context come from ``stats.locate_view``."""
    v = mojibake_view()
    stats = SimpleNamespace(step=100, events=[EVENT], locate=v.result, locate_view=(v.result, v.context),
                            not_localized=None, surgery=None)
    assert "sample 1, tokens 4-6: '\u00e2\u20ac\u2122'" in printed(stats, tmp_path)


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


def test_the_console_summary_reports_the_clip_after_warmup():
    base = {"seconds": 1.0, "final_loss": 2.0, "max_post_clip_grad_norm": 0.2}
    sat = {**base, "clip_steps_after_warmup": 80.0, "clip_clipped_fraction": 1.0, "clip_mean_coef": 0.29}
    ok = {**base, "clip_steps_after_warmup": 80.0, "clip_clipped_fraction": 0.3, "clip_mean_coef": 0.9}
    lines = summary_lines(130, "adagc", sat, [], "/tmp/run")
    assert "clip=adagc after warm-up: 100% of 80 steps clipped, mean coefficient 0.29 — a 3.4x learning-rate cut, " \
           "not a spike guard" in lines
    assert "clip=adagc after warm-up: 30% of 80 steps clipped, mean coefficient 0.90" in summary_lines(
        130, "adagc", ok, [], "/tmp/run")


def test_console_block_names_the_sample_and_the_micro_batch(tmp_path):
    events, result, ctx = levels_case()
    text = printed(SpikeView(12, events, result, ctx), tmp_path)
    # the whole sample's text is its loss-bearing tokens (the last position has no loss term)
    assert "micro-batch 1, sample 1, the whole sample: '<b>garbage & more</b>" in text and "(60% of" in text
    assert "micro-batch 2: the whole micro-batch (no sample or token in it stands out)" in text
    assert "micro-batch 0, sample 0, tokens 4-5" in text
    lines = [ln for ln in text.splitlines() if "culprits" in ln or ln.startswith("             ")]
    assert "(60% of" in lines[0]  # largest share first


def test_an_rl_completion_is_named_by_group_index_and_reward_and_shows_the_completion_not_the_prompt(tmp_path):
    """TRL's GRPO rows (and rl_grpo.py's) carry group/index/reward: the block names the completion, and its
    text is the completion's loss-bearing tokens, not the padded prompt before it."""
    tok = ByteTokenizer()
    B, P, C = 4, 6, 5
    ids = torch.zeros(B, P + C, dtype=torch.long)  # the prompt is padding (id 0) on the left
    ids[2, P:] = torch.tensor(tok.encode("oops!"))
    mask = torch.zeros(B, P + C)
    mask[:, P:] = 1.0
    ctx = SpikeContext(lambda m: m.sum(), mask, input_ids=ids, tokenizer=tok,
                       sample_columns={"group": torch.tensor([0, 0, 1, 1]), "index": torch.tensor([0, 1, 0, 1]),
                                       "reward": torch.tensor([0.5, 0.25, 0.125, 1.0])})
    row = Culprit("sample", 3.0, 0.97, batch=2, start=0, end=P + C, n_terms=C)
    view = SpikeView(30, [EVENT], LocateResult([], 4, "auto", 0.1, 3.0, culprits=[row]), ctx)
    text = printed(view, tmp_path)
    assert "culprits   completion 0 of group 1, reward 0.125 (sample 2), the whole completion: 'oops!'  (97% of" \
        in text and "\\x00" not in text
    assert spike_summary([view], tmp_path)[1].startswith("  step 30: 1 completion: completion 0 of group 1")


def test_a_packed_document_is_named_and_counted(tmp_path):
    tok = ByteTokenizer()
    ids = torch.tensor([list(b"abcdefgh\xc3\xa2\xc3\xa2xyuv")])  # (1, 16): documents 0 | 1 | 2
    docs = torch.tensor([[0] * 8 + [1] * 4 + [2] * 4])
    ctx = SpikeContext(lambda m: m.sum(), torch.ones(1, 16), input_ids=ids, tokenizer=tok, document_ids=docs)
    rows = [Culprit("sample", 2.0, 0.95, batch=0, start=7, end=12, document=1, n_terms=4),
            CulpritToken(0, 14, grad_norm=0.1, share=-0.0007)]  # a row pulling against the spike reads 0%
    view = SpikeView(50, [EVENT], LocateResult(rows[1:], 4, "auto", 0.1, 2.0, culprits=rows), ctx)
    text = printed(view, tmp_path)
    assert "culprits   document 1 (sample 0), the whole document: 'ââ'  (95% of" in text
    assert "document 2 (sample 0), token 14: 'u'  (0% of" in text and "-0%" not in text
    assert culprit_count(view) == "2 documents (1 whole, 1 token)"


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


def test_a_block_that_cannot_be_printed_warns_and_never_raises(tmp_path, recwarn):
    view = mojibake_view()
    view.context.tokenizer = None
    view.context.input_ids = "not a tensor"
    TrainConsole(stream=io.StringIO()).spike(view, tmp_path)
    assert any("could not print the spike block of step 100" in str(w.message) for w in recwarn)


def test_console_block_without_culprits_gives_the_per_sample_shares(tmp_path):
    result = LocateResult([], probes=6, method="auto", threshold=0.3, total_norm=3.0,
                          sample_shares=[{"micro_batch": None, "sample": 3, "document": None, "share": 0.21,
                                          "grad_norm": 1.0}])
    ctx = SpikeContext(lambda m: m.sum(), torch.ones(4, T_LEVELS), input_ids=torch.zeros(4, T_LEVELS, dtype=torch.long))
    text = printed(SpikeView(12, [], result, ctx), tmp_path)
    assert "none found: no sample, span or token stands out" in text
    assert "largest per-sample shares: sample 3 21%" in text
