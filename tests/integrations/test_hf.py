"""A real ``transformers.Trainer`` run with ``GradLocCallback``: one run, Trainer's and ours; a
non-finite step skipped bitwise with Trainer's default (fused) optimizer."""
from __future__ import annotations

import html
import json
import re
import warnings
from pathlib import Path

import pytest
import torch

from .conftest import (
    BATCH,
    CORRUPT,
    FAST,
    INJECT_AT,
    LOG_EVERY,
    LR,
    SEQ,
    STEPS,
    VOCAB,
    corrupted_positions,
    counting_batch,
    micro_batches,
    mlflow_table,
)
from .counting_case import (
    DOC,
    RARE,
    RARE_AT,
    CharTokenizer,
    counting_model_state,
    garbage_document,
    run_trainer,
)
from .counting_case import STEPS as COUNTING_STEPS
from .nonfinite import BAD, QUIET, assert_same, poison, snapshot

pytest.importorskip("transformers")
K = 2  # gradient_accumulation_steps


def hf_dataset(k: int) -> list[dict]:
    """The micro-batches of every step, flattened into samples in training order."""
    return [{key: v[b] for key, v in mb.items()}
            for step in range(STEPS) for mb in micro_batches(step, k) for b in range(mb["input_ids"].shape[0])]


def train(model, tmp_path, report_to, callback, k: int = K, max_grad_norm: float = 0.0, **more):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=BATCH // k, gradient_accumulation_steps=k,
        max_steps=STEPS, learning_rate=LR, lr_scheduler_type="constant", weight_decay=0.0, logging_steps=LOG_EVERY,
        report_to=report_to, save_strategy="no", max_grad_norm=max_grad_norm, train_sampling_strategy="sequential",
        use_cpu=True, disable_tqdm=True, dataloader_num_workers=0, seed=0, **more)
    trainer = Trainer(model=model, args=args, train_dataset=hf_dataset(k), callbacks=[callback])
    trainer.train()
    return trainer


def check_rows(rows: list[dict]) -> None:
    """The corrupted sample's tokens, in its micro-batch, at Trainer's step of that update."""
    assert {r["step"] for r in rows} == {INJECT_AT + 1}  # Trainer logs update s at global_step s + 1
    assert {(r["micro_batch"], r["sample"], r["position"]) for r in rows} == {
        (K - 1, CORRUPT, p) for p in corrupted_positions()}


def test_trainer_mlflow_one_run_holds_trainers_metrics_and_ours(gpt2, tmp_path, mlflow_store, monkeypatch):
    from gradloc_track.integrations.hf import GradLocCallback

    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "hf")
    callback = GradLocCallback(**FAST, log_every=LOG_EVERY)
    train(gpt2, tmp_path, ["mlflow"], callback)

    client = mlflow_store.client
    runs = mlflow_store.new_runs()
    assert len(runs) == 1, [r.info.run_name for r in runs]
    (run,) = runs
    assert run.info.status == "FINISHED"  # ended by Trainer's MLflowCallback, the run's owner
    metrics = run.data.metrics
    assert "loss" in metrics and "grad_norm" in metrics  # Trainer's
    assert "grad_norm/global" in metrics and any(k.startswith("clip/threshold/") for k in metrics)  # ours
    ours = [m.step for m in client.get_metric_history(run.info.run_id, "grad_norm/global")]
    trainers = [m.step for m in client.get_metric_history(run.info.run_id, "loss")]
    logged = list(range(LOG_EVERY, STEPS + 1, LOG_EVERY))
    assert sorted(trainers) == logged and sorted(ours) == sorted(logged + [INJECT_AT + 1])  # one step axis
    table = mlflow_table(client, run.info.run_id, tmp_path)
    check_rows([dict(zip(table["columns"], r)) for r in table["data"]])


def test_trainer_wandb_offline_run_holds_our_metrics_and_table(gpt2, tmp_path, monkeypatch):
    import wandb

    from gradloc_track.integrations.hf import GradLocCallback

    from ..wandb_reader import history

    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_PROJECT", "hf")
    train(gpt2, tmp_path, ["wandb"], GradLocCallback(**FAST, log_every=LOG_EVERY))
    run = wandb.run
    assert run is not None  # Trainer's run: we did not end it
    # the run's own folder: wandb keeps the WANDB_DIR of the process's first run (an earlier test's)
    run_dir = Path(run.dir).parent
    run.finish()
    rows = history(run_dir)
    ours = [r for r in rows if "grad_norm/global" in r]
    logged = list(range(LOG_EVERY, STEPS + 1, LOG_EVERY))
    assert sorted(r["train/global_step"] for r in ours) == sorted(logged + [INJECT_AT + 1])
    assert any("train/loss" in r for r in rows)  # Trainer's own metrics in the same run
    tables = [json.loads(p.read_text()) for p in (run_dir / "files" / "media" / "table").rglob("*.table.json")]
    (table,) = [t for t in tables if t["data"] and "level" in t["columns"]][:1]  # spikes/tokens, not the events
    check_rows([dict(zip(table["columns"], r)) for r in table["data"]])


def test_torch_compile_true_is_localized_through_trainers_compiled_wrapper(gpt2, tmp_path):
    """Held-out tester, stop 57: ``torch_compile=True`` has Trainer (accelerate) wrap the model in torch.compile's
    ``OptimizedModule``; the callback's hooks on the model ran traced inside its graph and recorded nothing, so the
    spike read "not localized" and a warning told a Trainer user to give watch() the compiled module. (Dynamo's
    eager backend: the same wrapper and traced hooks, without inductor's code generation.)"""
    from gradloc_track import MemoryTracker
    from gradloc_track.integrations.hf import GradLocCallback

    tracker = MemoryTracker()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = train(gpt2, tmp_path, [], GradLocCallback(**FAST, tracker=tracker, run_dir=tmp_path / "run"),
                        torch_compile=True, torch_compile_backend="eager")
    assert type(trainer.model_wrapped).__name__ == "OptimizedModule"  # Trainer really trained through it
    assert not [w for w in caught if "traced into its graph" in str(w.message)]
    table = tracker.tables["spikes/tokens"]
    check_rows([dict(zip(table["columns"], r)) for r in table["rows"]])


def test_taking_over_trainers_clipping_is_said_once(gpt2, tmp_path):
    from gradloc_track.integrations.hf import GradLocCallback

    callback = GradLocCallback(clip="adagc", spikes=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from transformers import Trainer, TrainingArguments

        args = TrainingArguments(output_dir=str(tmp_path / "o"), per_device_train_batch_size=2, max_steps=2,
                                 report_to=[], save_strategy="no", max_grad_norm=1.0, use_cpu=True,
                                 disable_tqdm=True)
        trainer = Trainer(model=gpt2, args=args, train_dataset=hf_dataset(1)[:4], callbacks=[callback])
        trainer.train()
        trainer.train()  # a second train() does not say it again
    said = [w for w in caught if "takes over Trainer's gradient clipping" in str(w.message)]
    assert len(said) == 1 and "max_grad_norm=1.0" in str(said[0].message) and "clip='adagc'" in str(said[0].message)
    assert callback.handle.last.step == 2
    assert args.max_grad_norm == 1.0  # the user's arguments read as written once train() is over


def grad_snapshot(step: int, after_step: bool = False):
    """A callback (a class of its own: Trainer keeps one callback per class) that copies the
    gradients at ``on_pre_optimizer_step`` of update ``step`` (``after_step``: at ``on_optimizer_step``,
    the gradient the optimizer used: a global clip beside Trainer's fused AdamW is applied inside its step)."""
    from transformers import TrainerCallback

    class GradSnapshot(TrainerCallback):
        grads = None

        def _copy(self, state, model):
            if state.global_step + 1 == step:
                self.grads = [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]

        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            if not after_step:
                self._copy(state, model)

        def on_optimizer_step(self, args, state, control, model=None, **kwargs):
            if after_step:
                self._copy(state, model)

    return GradSnapshot()


LONG = 10  # loss terms of this test's garbage document: 8.7% of its step's terms


def long_garbage_dataset() -> list[dict]:
    """The usual micro-batches, but the garbage document has LONG loss terms."""
    def batch(step: int, i: int) -> dict:
        b = counting_batch(step * K + i, BATCH // K)
        if (step, i) == (INJECT_AT, K - 1):
            garbage = (torch.arange(LONG + 1) * 29 + 7) % VOCAB  # jumps of 29: never "count up by one"
            b["input_ids"][CORRUPT], b["labels"][CORRUPT], b["attention_mask"][CORRUPT] = 0, -100, 0
            b["input_ids"][CORRUPT, : LONG + 1] = b["labels"][CORRUPT, : LONG + 1] = garbage
            b["attention_mask"][CORRUPT, : LONG + 1] = 1
        return b

    return [{key: v[j] for key, v in batch(step, i).items()}
            for step in range(STEPS) for i in range(K) for j in range(BATCH // K)]


def test_default_max_grad_norm_spike_is_detected_localized_and_clipped_as_trainer_would(tmp_path):
    """TrainingArguments' default max_grad_norm=1.0: the monitor sees the pre-clip gradient (the
    spike, 1.3 against ~0.1 before it, is detected and localized), Trainer's logged grad_norm is
    that pre-clip norm, and the optimizer gets the gradient ``clip_grad_norm_(..., 1.0)`` would
    have given it. (GPT-2 with n_embd=64: at n_embd=32 a spike of under 10% of the terms stays
    below 1.0, and Trainer's clipping would hide nothing.)"""
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from gradloc_track import MemoryTracker
    from gradloc_track.integrations.hf import GradLocCallback

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=64, n_layer=2, n_head=2,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    tracker = MemoryTracker()
    ours = GradLocCallback(spikes=FAST["spikes"], tracker=tracker, run_dir=tmp_path / "run")
    spike = INJECT_AT + 1  # Trainer's step of the injected update
    before, after = grad_snapshot(spike), grad_snapshot(spike, after_step=True)
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=BATCH // K, gradient_accumulation_steps=K,
        max_steps=STEPS, learning_rate=LR, lr_scheduler_type="constant", weight_decay=0.0, logging_steps=1,
        report_to=[], save_strategy="no", train_sampling_strategy="sequential", use_cpu=True, disable_tqdm=True,
        seed=0)
    assert args.max_grad_norm == 1.0  # Trainer's default, left as it is
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = Trainer(model=model, args=args, train_dataset=long_garbage_dataset(),
                          callbacks=[before, ours, after])
        trainer.train()
    assert spike in [s.step for s in ours.handle.spikes]
    table = tracker.tables["spikes/tokens"]
    rows = [dict(zip(table["columns"], r)) for r in table["rows"]]
    # the long garbage document is one culprit: a whole-sample row (no few tokens carry it), spanning its LONG
    # loss terms, not its padding
    assert [(r["level"], r["micro_batch"], r["sample"], r["position"], r["end"]) for r in rows
            if r["step"] == spike] == [("sample", K - 1, CORRUPT, 0, LONG)]
    # the localizer ran after the clip: its step check takes the clip coefficient, so the step is reproduced
    (located,) = [s.locate for s in ours.handle.spikes if s.step == spike]
    assert located.step_check.replayed and located.step_check.norm_ratio == pytest.approx(1.0, abs=1e-4)
    assert not any("probes' sum" in n for n in located.notes), located.notes
    trainers = {e["step"]: e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e}
    assert trainers[spike] == pytest.approx(dict(tracker.series("grad_norm/global"))[spike], rel=1e-5)
    assert trainers[spike] > 1.0
    expected = [torch.nn.Parameter(torch.zeros_like(g)) for g in before.grads]
    for p, g in zip(expected, before.grads):
        p.grad = g.clone()
    torch.nn.utils.clip_grad_norm_(expected, 1.0)  # what Trainer (accelerator.clip_grad_norm_) would have done
    for got, want in zip(after.grads, expected):
        torch.testing.assert_close(got, want.grad, rtol=1e-6, atol=1e-9)
    assert torch.linalg.vector_norm(torch.stack([g.norm() for g in after.grads])).item() == pytest.approx(1.0, 1e-5)


def test_hf_trainer_default_optimizer_skips_bitwise(gpt2, tmp_path):
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from gradloc_track.integrations.hf import GradLocCallback

    seen = {}

    class Poison(TrainerCallback):  # runs before GradLocCallback's on_pre_optimizer_step
        def on_pre_optimizer_step(self, args, state, control, model=None, optimizer=None, **kw):
            if state.global_step == BAD:
                poison(model)
                seen["before"] = snapshot(list(model.parameters()), optimizer)

        def on_optimizer_step(self, args, state, control, model=None, optimizer=None, **kw):
            if state.global_step == BAD:
                seen["after"] = snapshot(list(model.parameters()), optimizer)

    gradloc = GradLocCallback(**QUIET)
    args = TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=BATCH, max_steps=6,
                             learning_rate=LR, report_to=[], save_strategy="no", max_grad_norm=0.0, use_cpu=True,
                             disable_tqdm=True, dataloader_num_workers=0, seed=0)
    Trainer(model=gpt2, args=args, train_dataset=hf_dataset(1), callbacks=[Poison(), gradloc]).train()
    assert gradloc.handle.monitor.skip_guard.mode == "fused"  # Trainer's default: adamw_torch_fused
    assert_same(seen["after"], seen["before"])
    assert all(torch.isfinite(p).all() for p in gpt2.parameters())


@pytest.fixture(scope="module")
def counting_weights():
    return counting_model_state()


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "gradient-checkpointing"])
def test_a_garbage_document_is_a_sample_and_a_rare_token_is_tokens(counting_weights, tmp_path, checkpointing):
    handle, tracker = run_trainer(counting_weights, tmp_path, checkpointing)
    (stats,) = handle.spikes
    assert stats.step == COUNTING_STEPS  # Trainer logs update s at global_step s + 1
    res = stats.locate
    assert res.step_check.replayed and res.step_check.residual < 1e-4  # the probes ARE the step
    by_level = {}
    for c in res.culprits:
        by_level.setdefault(c.level, set()).add((c.micro_batch, c.batch) if c.level != "token"
                                                else (c.micro_batch, c.batch, c.position))
    assert by_level.get("sample") == {DOC}  # the document, by micro-batch and sample
    tokens = by_level.get("token", set())
    rare_inputs = {(*RARE, p) for p in RARE_AT}  # terms whose input is the rare token
    assert rare_inputs <= tokens <= rare_inputs | {(*RARE, p - 1) for p in RARE_AT}  # ...and those predicting it
    doc = next(c for c in res.culprits if c.level == "sample")
    assert doc.share > 0.3

    table = tracker.tables["spikes/tokens"]  # (spikes/events holds the detected step)
    cols = table["columns"]
    assert "level" in cols
    rows = [dict(zip(cols, r)) for r in table["rows"]]
    (sample_row,) = [r for r in rows if r["level"] == "sample"]
    assert (sample_row["micro_batch"], sample_row["sample"]) == DOC
    text = CharTokenizer().decode(garbage_document())
    assert text[1:] in sample_row["token"]  # the document's text (its loss terms: positions 1..T-1)
    ((_, _, page),) = tracker.html
    section = re.search(r"<h2>micro-batch 3, sample 1</h2><div class='meta'>([^<]*)</div>"
                        r"<div class='text'>(.*?)</div>", page)
    assert section and "culprit whole sample" in section.group(1)
    assert '<span class="u" title="CULPRIT sample' in section.group(2)  # outlined as a whole
    assert text[1:] in html.unescape(re.sub(r"<[^>]+>", "", section.group(2)))  # its text, in order
    assert re.search(r"<h2>micro-batch 1, sample 0</h2>", page) and '<span class="t c"' in page


def sample_rows(rows: list[dict]) -> list[tuple]:
    return [(r["level"], r["micro_batch"], r["sample"]) for r in rows if r["level"] != "token"]


def test_in_trainers_mlflow_run_with_its_defaults(counting_weights, tmp_path, mlflow_store, monkeypatch):
    """Trainer's own MLflow run, ``max_grad_norm=1.0`` left as it is: the document's sample row and
    the rare token's rows are in the run's table."""
    from .conftest import mlflow_table

    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "hf-dropout")
    handle, _ = run_trainer(counting_weights, tmp_path, False, report_to=["mlflow"])
    assert [s.step for s in handle.spikes] == [COUNTING_STEPS]
    (run,) = mlflow_store.new_runs()
    table = mlflow_table(mlflow_store.client, run.info.run_id, tmp_path)
    rows = [dict(zip(table["columns"], r)) for r in table["data"]]
    assert sample_rows(rows) == [("sample", *DOC)]
    assert {(r["micro_batch"], r["sample"]) for r in rows if r["level"] == "token"} == {RARE}


def test_in_trainers_wandb_offline_run_with_its_defaults(counting_weights, tmp_path, monkeypatch):
    """The same through Trainer's W&B run (offline): the table in the run's files."""
    import json
    from pathlib import Path

    import wandb

    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_PROJECT", "hf-dropout")
    handle, _ = run_trainer(counting_weights, tmp_path, False, report_to=["wandb"])
    assert [s.step for s in handle.spikes] == [COUNTING_STEPS]
    run_dir = Path(wandb.run.dir).parent
    wandb.run.finish()
    tables = [json.loads(p.read_text()) for p in (run_dir / "files" / "media" / "table").rglob("*.table.json")]
    (table,) = [t for t in tables if t["data"] and "level" in t["columns"]][:1]
    rows = [dict(zip(table["columns"], r)) for r in table["data"]]
    assert sample_rows(rows) == [("sample", *DOC)]
    assert {(r["micro_batch"], r["sample"]) for r in rows if r["level"] == "token"} == {RARE}
    # the culprit ledger reads the W&B offline run dir: the document's sample, blamed once
    from gradloc_track.ledger import by_sample, collect, read_runs

    ledger = {e["sample_id"]: e for e in by_sample(collect(read_runs([str(run_dir)])))}
    (doc_id,) = {r["sample_id"] for r in rows if r["level"] == "sample"}
    assert ledger[doc_id]["blamed"] == 1 and ledger[doc_id]["steps"][0].endswith(f"@{COUNTING_STEPS}")
