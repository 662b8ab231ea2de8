"""HF Trainer, GPT-2 with its default dropout (0.1), ``gradient_accumulation_steps=4``: the spike's
cause named at its level (issue 16, items 1-2).

A tiny GPT-2 that has learned to count meets, at the last step, a whole garbage document (every
token random: many terms, none alone above the token threshold) in micro-batch 3 and a rare
token (an id never seen in training) repeated in micro-batch 1. The document is a culprit
SAMPLE, shown with its text; the rare token's terms are TOKENS. Also with gradient checkpointing
(recomputation replays the forward's RNG through torch.utils.checkpoint).
"""
from __future__ import annotations

import html
import re
import warnings

import pytest
import torch

pytest.importorskip("transformers")

V, T, B, K, COUNT = 64, 32, 8, 4, 56  # normal text counts up mod 56: ids 56..63 never occur
STEPS = 5
ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
DOC, RARE = (3, 1), (1, 0)  # (micro-batch, sample) at the last step
RARE_ID, RARE_AT = 60, (6, 15, 24)


class CharTokenizer:
    def decode(self, ids):
        return "".join(ALPHABET[int(i)] for i in ids)


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)  # default dropout: resid/embd/attn 0.1
    return GPT2LMHeadModel(GPT2Config(vocab_size=V, n_positions=T, n_embd=32, n_layer=2, n_head=2))


def counting(i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    return (torch.randint(0, COUNT, (1,), generator=g) + torch.arange(T)) % COUNT


@pytest.fixture(scope="module")
def counting_model_state():
    """A plain loop teaches the model to count (60 steps, ~2 s); each test starts from its weights."""
    model = gpt2()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for s in range(60):
        x = torch.stack([counting(10_000 + s * B + b) for b in range(B)])
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    return {k: v.clone() for k, v in model.state_dict().items()}


def garbage_document() -> torch.Tensor:
    return torch.randint(0, COUNT, (T,), generator=torch.Generator().manual_seed(99))


def dataset() -> list[dict]:
    data = []
    for i in range(STEPS * B):
        ids = counting(i)
        step, rest = divmod(i, B)
        where = divmod(rest, B // K)  # (micro-batch, sample)
        if step == STEPS - 1 and where == DOC:
            ids = garbage_document()
        if step == STEPS - 1 and where == RARE:
            ids = ids.clone()
            ids[list(RARE_AT)] = RARE_ID
        data.append({"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones(T, dtype=torch.long)})
    return data


def run_trainer(state, tmp_path, checkpointing: bool, report_to: list[str] | None = None):
    """``report_to`` None: into a MemoryTracker, Trainer's clipping off; else into Trainer's own run,
    with Trainer's defaults (``max_grad_norm=1.0``, taken over by the callback)."""
    from transformers import Trainer, TrainingArguments

    from gradloc_track.integrations.hf import GradLocCallback
    from gradloc_track.trackers.memory import MemoryTracker

    model = gpt2()
    model.load_state_dict(state)
    tracker = MemoryTracker() if report_to is None else None
    callback = GradLocCallback(spikes={"warmup_steps": STEPS - 2, "ratio_thresh": 2.0, "alpha": 0.9},
                               tracker=tracker, tokenizer=CharTokenizer(), log_every=1000)
    defaults = {} if report_to is not None else {"max_grad_norm": 0.0}
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=B // K, gradient_accumulation_steps=K,
        max_steps=STEPS, learning_rate=1e-2, lr_scheduler_type="constant", report_to=report_to or [],
        save_strategy="no", use_cpu=True, disable_tqdm=True, dataloader_num_workers=0, seed=0,
        gradient_checkpointing=checkpointing, train_sampling_strategy="sequential", logging_steps=1000, **defaults)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        Trainer(model=model, args=args, train_dataset=dataset(), callbacks=[callback]).train()
    return callback.handle, tracker


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "gradient-checkpointing"])
def test_a_garbage_document_is_a_sample_and_a_rare_token_is_tokens(counting_model_state, tmp_path, checkpointing):
    handle, tracker = run_trainer(counting_model_state, tmp_path, checkpointing)
    (stats,) = handle.spikes
    assert stats.step == STEPS  # Trainer logs update s at global_step s + 1
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

    (table,) = tracker.tables.values()
    cols = table["columns"]
    assert "level" in cols
    rows = [dict(zip(cols, r)) for r in table["rows"]]
    (sample_row,) = [r for r in rows if r["level"] == "sample"]
    assert (sample_row["micro_batch"], sample_row["sample"]) == DOC
    text = CharTokenizer().decode(garbage_document())
    assert text[1:] in sample_row["token"]  # the document's text (its loss terms: positions 1..T-1)
    ((_, _, page),) = tracker.html
    section = re.search(r"<h2>micro-batch 3 · sample 1</h2><div class='meta'>([^<]*)</div>"
                        r"<div class='text'>(.*?)</div>", page)
    assert section and "culprit whole sample" in section.group(1)
    assert '<span class="u" title="CULPRIT sample' in section.group(2)  # outlined as a whole
    assert text[1:] in html.unescape(re.sub(r"<[^>]+>", "", section.group(2)))  # its text, in order
    assert re.search(r"<h2>micro-batch 1 · sample 0</h2>", page) and '<span class="t c"' in page


def sample_rows(rows: list[dict]) -> list[tuple]:
    return [(r["level"], r["micro_batch"], r["sample"]) for r in rows if r["level"] != "token"]


def test_in_trainers_mlflow_run_with_its_defaults(counting_model_state, tmp_path, mlflow_store, monkeypatch):
    """Trainer's own MLflow run, ``max_grad_norm=1.0`` left as it is: the document's sample row and
    the rare token's rows are in the run's table."""
    from .conftest import mlflow_table

    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "hf-dropout")
    handle, _ = run_trainer(counting_model_state, tmp_path, False, report_to=["mlflow"])
    assert [s.step for s in handle.spikes] == [STEPS]
    (run,) = mlflow_store.new_runs()
    table = mlflow_table(mlflow_store.client, run.info.run_id, tmp_path)
    rows = [dict(zip(table["columns"], r)) for r in table["data"]]
    assert sample_rows(rows) == [("sample", *DOC)]
    assert {(r["micro_batch"], r["sample"]) for r in rows if r["level"] == "token"} == {RARE}


def test_in_trainers_wandb_offline_run_with_its_defaults(counting_model_state, tmp_path, monkeypatch):
    """The same through Trainer's W&B run (offline): the table in the run's files."""
    import json
    from pathlib import Path

    import wandb

    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_PROJECT", "hf-dropout")
    handle, _ = run_trainer(counting_model_state, tmp_path, False, report_to=["wandb"])
    assert [s.step for s in handle.spikes] == [STEPS]
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
    assert ledger[doc_id]["blamed"] == 1 and ledger[doc_id]["steps"][0].endswith(f"@{STEPS}")
