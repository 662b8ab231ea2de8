"""A tiny GPT-2 trained by ``transformers.Trainer`` with gradloc-track's callback: CPU, offline.

    python examples/hf_trainer.py                          # Trainer's MLflow run in ./mlflow.db
    python examples/hf_trainer.py --report-to wandb        # Trainer's W&B run (WANDB_MODE=offline works)
    python examples/hf_trainer.py --report-to none         # local files under --out only

A corrupted document (a few bytes of mojibake, the rest padding) lands in the second micro-batch
of step ``--inject-at``. The callback sees the gradient spike, names the garbage tokens and their
micro-batch, and writes the token table (``spikes/tokens``), the highlighted text
(``spikes/highlight``) and the layer heatmap (``spikes/heatmap``) into Trainer's own run, beside
Trainer's ``loss`` and ``grad_norm``. The only gradloc-track line is the callback.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

from gradloc_track.demo.data import ByteTokenizer

PAD = 0  # byte 0 never occurs in the corpus


def samples(steps: int, accum: int, micro: int, seq: int, inject_at: int, span: int) -> list[dict]:
    """Every step's micro-batches as samples in training order (HF style: input_ids, labels, mask).

    The text is the alphabet from a random letter on ("qrstuvwxyzabc..."), which a tiny model
    learns within ~50 steps, so that one corrupted document later stands out as it would in a
    trained model. Byte-level tokens (``ByteTokenizer``) keep the decoded text readable.
    """
    alphabet = torch.tensor(list(b"abcdefghijklmnopqrstuvwxyz"))
    out = []
    for step in range(steps):
        for k in range(accum):
            g = torch.Generator().manual_seed(step * accum + k)
            start = torch.randint(0, 26, (micro, 1), generator=g)
            ids = alphabet[(start + torch.arange(seq)) % 26]  # (B, T)
            att = torch.ones_like(ids)
            if step == inject_at and k == accum - 1:  # a short garbage document in sample 1
                ids[1] = PAD
                att[1] = 0
                ids[1, : span + 1] = torch.randint(0xC0, 0x100, (span + 1,), generator=g)
                att[1, : span + 1] = 1
            labels = ids.masked_fill(att == 0, -100)
            out += [{"input_ids": ids[b], "attention_mask": att[b], "labels": labels[b]} for b in range(len(ids))]
    return out


def main(argv: list[str] | None = None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--inject-at", type=int, default=60)
    ap.add_argument("--span", type=int, default=6, help="loss tokens of the garbage document")
    ap.add_argument("--accum", type=int, default=2, help="gradient_accumulation_steps")
    ap.add_argument("--micro", type=int, default=4, help="per_device_train_batch_size")
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--report-to", default="mlflow", choices=["mlflow", "wandb", "none"])
    ap.add_argument("--out", default="runs/hf_trainer")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from gradloc_track.integrations.hf import GradLocCallback

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=args.seq, n_embd=32, n_layer=2, n_head=2,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None,
                                       eos_token_id=None))
    os.environ.setdefault("MLFLOW_EXPERIMENT_NAME", "gradloc-track-hf")
    if args.report_to == "mlflow":
        os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{Path.cwd() / 'mlflow.db'}")
    callback = GradLocCallback(                          # <- gradloc-track
        clip={"kind": "adagc", "warmup_steps": 10}, spikes={"warmup_steps": 20, "alpha": 0.9},
        tokenizer=ByteTokenizer(), run_dir=args.out)
    targs = TrainingArguments(
        output_dir=args.out, per_device_train_batch_size=args.micro, gradient_accumulation_steps=args.accum,
        max_steps=args.steps, learning_rate=1e-2, lr_scheduler_type="constant", logging_steps=1,
        # Trainer's default max_grad_norm=1.0 stays: the callback takes that clipping over and clips with AdaGC
        report_to=[] if args.report_to == "none" else [args.report_to], save_strategy="no",
        train_sampling_strategy="sequential", use_cpu=True, disable_tqdm=True, seed=0)
    data = samples(args.steps, args.accum, args.micro, args.seq, args.inject_at, args.span)
    Trainer(model=model, args=targs, train_dataset=data, callbacks=[callback]).train()
    for stats in callback.handle.spikes:
        found = [(c.level, c.micro_batch, c.batch, c.start) for c in (stats.locate.culprits if stats.locate else [])]
        print(f"spike at step {stats.step}: {[e.signal for e in stats.events]}, culprits "
              f"(level, micro_batch, sample, position): {found}")
    return callback


if __name__ == "__main__":
    main()
