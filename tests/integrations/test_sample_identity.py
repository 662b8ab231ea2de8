"""Sample identity on culprit rows: the content fingerprint, the dataset index and the user's own
columns, from HF Trainer (through ``keep_columns``) and from a plain loop (``set_sample_info``)."""
from __future__ import annotations

import warnings

import pytest
import torch

import gradloc_track
from gradloc_track import MemoryTracker
from gradloc_track.artifacts.identity import sample_fingerprint

from .conftest import BATCH, CORRUPT, FAST, INJECT_AT, LR, SPAN, STEPS, counting_batch, micro_batches, tiny_gpt2
from .test_hf import K, hf_dataset


def garbage_id() -> str:
    """The corrupted document's fingerprint, computed offline from its labels the documented way:
    the loss-bearing ids are ``labels[1:]`` without -100 (each term predicts the next token)."""
    labels = counting_batch(0, corrupt_sample=0)["labels"][0]
    return sample_fingerprint(t for t in labels[1:].tolist() if t != -100)


def rows_of(tracker: MemoryTracker) -> list[dict]:
    table = tracker.tables["spikes/tokens"]
    return [dict(zip(table["columns"], r)) for r in table["rows"]]


def test_hf_trainer_rows_carry_the_dataset_index_and_a_metadata_column(gpt2, tmp_path):
    from transformers import Trainer, TrainingArguments

    from gradloc_track.integrations.hf import GradLocCallback, keep_columns, with_index

    data = hf_dataset(K)
    bad = INJECT_AT * BATCH + (K - 1) * (BATCH // K) + CORRUPT  # the corrupted sample's dataset index
    for i, row in enumerate(data):
        row["source"] = "forum" if i == bad else "web"  # a column gpt2.forward does not take
    tracker = MemoryTracker()
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=BATCH // K, gradient_accumulation_steps=K,
        max_steps=STEPS, learning_rate=LR, lr_scheduler_type="constant", weight_decay=0.0, report_to=[],
        save_strategy="no", max_grad_norm=0.0, train_sampling_strategy="sequential", use_cpu=True, disable_tqdm=True,
        remove_unused_columns=False, seed=0)
    collator = keep_columns(gpt2, "dataset_index", "source")
    trainer = Trainer(model=gpt2, args=args, train_dataset=with_index(data), data_collator=collator,
                      eval_dataset=with_index(data[:4]),
                      callbacks=[GradLocCallback(**FAST, tracker=tracker, run_dir=tmp_path / "run")])
    trainer.train()
    rows = rows_of(tracker)
    assert rows and {r["step"] for r in rows} == {INJECT_AT + 1}
    assert {(r["dataset_index"], r["source"], r["sample_id"]) for r in rows} == {(bad, "forum", garbage_id())}
    assert "eval_loss" in trainer.evaluate()  # evaluation batches carry the columns too: the model never sees them


def watched_run(k: int, corrupt_at: int, info: bool) -> list[dict]:
    """A plain loop (k micro-batches per step) whose step INJECT_AT holds the garbage document at
    sample ``corrupt_at`` of its last micro-batch; ``info``: hand each micro-batch's dataset
    indices and sources to the step with ``set_sample_info``."""
    model = tiny_gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    tracker = MemoryTracker()
    handle = gradloc_track.watch(model, opt, tracker=tracker, **FAST)
    for step in range(STEPS):
        mbs = micro_batches(step, k)
        if step == INJECT_AT:
            mbs[-1] = counting_batch(step * k + k - 1, BATCH // k, corrupt_sample=corrupt_at)
        for i, mb in enumerate(mbs):
            first = (step * k + i) * (BATCH // k)
            if info:
                handle.set_sample_info(dataset_index=torch.arange(first, first + BATCH // k),
                                       source=["forum" if (step == INJECT_AT and i == k - 1 and b == corrupt_at)
                                               else "web" for b in range(BATCH // k)])
            (model(**mb).loss / k).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    handle.finish()
    return rows_of(tracker)


def test_plain_loop_rows_carry_fingerprint_and_user_columns_and_the_id_is_stable_across_runs():
    a = watched_run(k=2, corrupt_at=CORRUPT, info=True)
    assert {r["micro_batch"] for r in a} == {1} and len(a) == SPAN
    bad = (INJECT_AT * 2 + 1) * (BATCH // 2) + CORRUPT
    assert {(r["dataset_index"], r["source"], r["sample_id"]) for r in a} == {(bad, "forum", garbage_id())}
    b = watched_run(k=1, corrupt_at=5, info=False)  # another batch layout, the document elsewhere
    assert {r["sample"] for r in b} == {5} and {r["sample_id"] for r in b} == {garbage_id()}


def test_set_sample_info_checks_names_shapes_and_counts(gpt2):
    handle = gradloc_track.watch(gpt2, tracker=MemoryTracker(), spikes={"warmup_steps": 1})
    with pytest.raises(ValueError, match="'step' would shadow"):
        handle.set_sample_info(step=[1] * BATCH)
    with pytest.raises(TypeError, match="one value per sample"):
        handle.set_sample_info(reward=torch.zeros(BATCH, 2))
    handle.set_sample_info(reward=torch.zeros(BATCH))
    handle.set_sample_info(reward=torch.zeros(BATCH))  # two calls, one micro-batch
    gpt2(**counting_batch(0)).loss.backward()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        handle.step()
    assert any("called 2 time(s) for 1 captured micro-batch" in str(w.message) for w in caught)
    handle.remove()
