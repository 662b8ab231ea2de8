"""Shared pieces for the integration tests: a tiny randomly initialised GPT-2 and a toy corpus
it learns in a few steps (each sequence counts up by one), so one corrupted sample stands out."""
from __future__ import annotations

import pytest
import torch

VOCAB, SEQ, BATCH = 64, 16, 8
SPAN = 7  # loss tokens of the corrupted sample


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


def counting_batch(index: int, batch: int = BATCH, corrupt_sample: int | None = None) -> dict[str, torch.Tensor]:
    """HF-style batch: ``input_ids``/``labels`` (B, SEQ) counting up mod VOCAB from a seeded start.

    ``corrupt_sample``: that sample becomes a short garbage document: SPAN+1 tokens that never follow
    each other (labels on the first SPAN+1 positions), the rest padding (attention 0, label -100).
    """
    g = torch.Generator().manual_seed(index)
    start = torch.randint(0, VOCAB, (batch, 1), generator=g)
    ids = (start + torch.arange(SEQ)) % VOCAB  # (B, T)
    mask = torch.ones_like(ids)
    labels = ids.clone()
    if corrupt_sample is not None:
        garbage = (torch.arange(SPAN + 1) * 29 + 7) % VOCAB  # jumps of 29: never "count up by one"
        ids[corrupt_sample] = 0
        ids[corrupt_sample, : SPAN + 1] = garbage
        mask[corrupt_sample] = 0
        mask[corrupt_sample, : SPAN + 1] = 1
        labels[corrupt_sample] = -100
        labels[corrupt_sample, : SPAN + 1] = garbage
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


@pytest.fixture
def gpt2():
    return tiny_gpt2()


STEPS, INJECT_AT, LR = 60, 50, 1e-2  # the model has learned to count by step ~40
CORRUPT = 1  # the corrupted sample's index inside its micro-batch
# detector/clipper settings for a 60-step run (the defaults assume hundreds of steps: their
# variance still holds the fast-falling first steps, so the injected 4.7x jump reads as z ~ 1.6
# and ratio ~ 2.8 against the slower baseline: the ratio rule is what catches it here)
FAST = {"spikes": {"warmup_steps": 20, "alpha": 0.9, "ratio_thresh": 2.5}, "clip": {"kind": "adagc", "warmup_steps": 5}}
LOG_EVERY = 10  # fewer tracker writes keep the tests fast; spikes are still checked every step


def micro_batches(step: int, k: int) -> list[dict[str, torch.Tensor]]:
    """The step's ``k`` micro-batches (BATCH // k samples each); the last one carries the corrupted
    sample at step INJECT_AT."""
    return [counting_batch(step * k + i, BATCH // k, CORRUPT if (step == INJECT_AT and i == k - 1) else None)
            for i in range(k)]


def corrupted_positions() -> list[int]:
    """Positions (model positions: the term at t predicts token t+1) of the corrupted loss terms."""
    return list(range(SPAN))


def plain_loop(model, opt, k: int = 1, steps: int = STEPS) -> None:
    """A user's loop with gradient accumulation: nothing of gradloc-track in it."""
    for step in range(steps):
        for mb in micro_batches(step, k):
            (model(**mb).loss / k).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def mlflow_table(client, run_id: str, dest) -> dict:
    """The run's attribution table (one part per spike event under ``spikes/tokens/``), joined."""
    from pathlib import Path

    from gradloc_track.artifacts import read_table

    return read_table(Path(client.download_artifacts(run_id, "spikes", str(dest))).parent, "spikes/tokens")
