"""The counting case of tests/integrations/test_hf.py: HF Trainer, GPT-2 with its default dropout (0.1),
``gradient_accumulation_steps=4``: the spike's cause named at its level (issue 16, items 1-2).

A tiny GPT-2 that has learned to count meets, at the last step, a whole garbage document (every
token random: many terms, none alone above the token threshold) in micro-batch 3 and a rare
token (an id never seen in training) repeated in micro-batch 1. The document is a culprit
SAMPLE, shown with its text; the rare token's terms are TOKENS. Also with gradient checkpointing
(recomputation replays the forward's RNG through torch.utils.checkpoint).
"""
from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("transformers")

V, T, B, K, COUNT = 64, 32, 8, 4, 56  # normal text counts up mod 56: ids 56..63 never occur
STEPS = 5  # the garbage arrives at the last one
ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
DOC, RARE = (3, 1), (1, 0)  # (micro-batch, sample) at the last step
RARE_ID, RARE_AT = 60, (6, 15, 24)


class CharTokenizer:
    def decode(self, ids):
        return "".join(ALPHABET[int(i)] for i in ids)


def dropout_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)  # default dropout: resid/embd/attn 0.1
    return GPT2LMHeadModel(GPT2Config(vocab_size=V, n_positions=T, n_embd=32, n_layer=2, n_head=2))


def counting(i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    return (torch.randint(0, COUNT, (1,), generator=g) + torch.arange(T)) % COUNT


def counting_model_state():
    """A plain loop teaches the model to count (60 steps, ~2 s); each test starts from its weights."""
    model = dropout_gpt2()
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
    from gradloc_track.trackers.memory_tracker import MemoryTracker

    model = dropout_gpt2()
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
