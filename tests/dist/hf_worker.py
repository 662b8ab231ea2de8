"""One rank of HF Trainer under DDP (gloo) with ``GradLocCallback``: rows count up mod 32 (learnable), one row
of random high tokens (``BAD``) that sequential sampling puts on rank 1 at step ``BAD // ROWS_A_STEP + 1``.
Writes what the rank saw: its spikes, each with its culprits and whether the step check replayed the step."""
from __future__ import annotations

import json
import os
import sys

ROWS, BAD, ROWS_A_STEP = 320, 8 * 30 + 3, 8  # 2 ranks x 2 rows x 2 micro-batches a step
VOCAB, SEQ = 64, 24


def rows():
    import torch

    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(ROWS):
        start = int(torch.randint(0, 32, (1,), generator=g))
        out.append([(start + j) % 32 for j in range(SEQ)])
    out[BAD] = torch.randint(32, VOCAB, (SEQ,), generator=torch.Generator().manual_seed(7)).tolist()
    return out


def main(rank: int, world: int, port: str, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=port, WANDB_MODE="offline", OMP_NUM_THREADS="1")
    import torch
    from datasets import Dataset
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from gradloc_track.integrations.hf import GradLocCallback, keep_columns, with_index

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    data = rows()
    args = TrainingArguments(output_dir=os.path.join(out, "trainer"), per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, max_steps=BAD // ROWS_A_STEP + 2, learning_rate=2e-2,
                             report_to="none", save_strategy="no", remove_unused_columns=False, ddp_backend="gloo",
                             use_cpu=True, seed=0, disable_tqdm=True, train_sampling_strategy="sequential",
                             dataloader_num_workers=0)
    callback = GradLocCallback(tracker="none", run_dir=os.path.join(out, "run"), console=False,
                               spikes={"warmup_steps": 15})
    Trainer(model=model, args=args, train_dataset=with_index(Dataset.from_dict({"input_ids": data, "labels": data})),
            data_collator=keep_columns(model, "dataset_index"), callbacks=[callback]).train()
    seen = [{"step": s.step, "replayed": bool(s.locate and s.locate.step_check and s.locate.step_check.replayed),
             "norm_ratio": s.locate.step_check.norm_ratio if s.locate and s.locate.step_check else None,
             "scale": s.locate.step_check.scale if s.locate and s.locate.step_check else None,
             "culprits": [[c.rank, c.level, c.share] for c in (s.locate.culprits if s.locate else [])],
             "why_not": s.not_localized, "cause": s.cause} for s in callback.handle.spikes]
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(seen, f)
    sys.stdout.flush()
