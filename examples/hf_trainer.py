"""A tiny GPT-2 trained by ``transformers.Trainer`` with gradloc-track's callback: CPU, offline.

    python examples/hf_trainer.py                          # Trainer's MLflow run in ./mlflow.db
    python examples/hf_trainer.py --report-to wandb        # Trainer's W&B run (WANDB_MODE=offline works)
    python examples/hf_trainer.py --report-to none         # local files under --out only

A corrupted document (mojibake, ``â€™`` as UTF-8 bytes, the rest padding) lands in the second
micro-batch of step ``--inject-at`` (Trainer's step numbers: its first update is step 1). The callback sees the
gradient spike and prints the spike block (the garbage text, its level and share, the run's
link), and writes the token table (``spikes/tokens``), the highlighted text
(``spikes/highlight``) and the layer heatmap (``spikes/heatmap``) into Trainer's own run, beside
Trainer's ``loss`` and ``grad_norm``. The only gradloc-track line is the callback. The console
(the block, the summary) is the script's stdout; each run writes to a new ``runs/hf_trainer/<date>_<time>``.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from pathlib import Path

import torch

from gradloc_track.console import TrainConsole, closing_lines
from gradloc_track.demo.data import ByteTokenizer
from gradloc_track.demo.extras import need
from gradloc_track.demo.out_dir import run_dir_for
from gradloc_track.demo.threads import set_threads
from gradloc_track.trackers.quiet import quiet_backend_noise

PAD = 0  # byte 0 never occurs in the corpus
MOJIBAKE = "\u00e2\u20ac\u2122"  # 'â€™': a curly apostrophe decoded with the wrong charset, 8 UTF-8 bytes


def garbage(span: int) -> list[int]:
    """The garbage document's bytes: a space (context, no loss term) and ``span`` bytes of mojibake, the
    loss terms: bytes the alphabet-trained model never saw, which a byte tokenizer decodes back to text."""
    text = (MOJIBAKE * (span // 8 + 1)).encode("utf-8")[:span]
    return [ord(" "), *text]


def samples(steps: int, accum: int, micro: int, seq: int, inject_at: int, span: int, first_step: int = 0) -> list[dict]:
    """Every step's micro-batches as samples in training order (HF style: input_ids, labels, mask).

    The text is the alphabet from a random letter on ("qrstuvwxyzabc..."), which a tiny model
    learns within ~50 steps, so that one corrupted document later stands out as it would in a
    trained model. Byte-level tokens (``ByteTokenizer``) keep the decoded text readable.
    ``first_step``: the number the trainer gives its first update (Trainer: 1, Lightning: 0), so
    the garbage lands in the update the trainer logs as ``inject_at``.
    """
    alphabet = torch.tensor(list(b"abcdefghijklmnopqrstuvwxyz"))
    out = []
    for update in range(steps):
        step = update + first_step
        for k in range(accum):
            g = torch.Generator().manual_seed(update * accum + k)
            start = torch.randint(0, 26, (micro, 1), generator=g)
            ids = alphabet[(start + torch.arange(seq)) % 26]  # (B, T)
            att = torch.ones_like(ids)
            if step == inject_at and k == accum - 1:  # a short garbage document in sample 1
                ids[1] = PAD
                att[1] = 0
                ids[1, : span + 1] = torch.tensor(garbage(span))
                att[1, : span + 1] = 1
            labels = ids.masked_fill(att == 0, -100)
            out += [{"input_ids": ids[b], "attention_mask": att[b], "labels": labels[b]} for b in range(len(ids))]
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--inject-at", type=int, default=60, help="the step (as Trainer numbers it) of the garbage")
    ap.add_argument("--span", type=int, default=8, help="loss tokens (bytes) of the garbage document")
    ap.add_argument("--accum", type=int, default=2, help="gradient_accumulation_steps")
    ap.add_argument("--micro", type=int, default=4, help="per_device_train_batch_size")
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--report-to", default="mlflow", choices=["mlflow", "wandb", "none"])
    ap.add_argument("--out", default=None, help="the run dir (default: a new runs/hf_trainer/<date>_<time>)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: half the cores, at most 4)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None):
    args = parse_args(argv)
    need("transformers", "accelerate")  # pip install 'gradloc-track[examples]'
    try:
        args.out = run_dir_for(args.out, "hf_trainer")
    except ValueError as exc:
        sys.exit(f"error: {exc}")
    set_threads(args.threads)
    warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")  # their deprecations
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
    from transformers.trainer_callback import PrinterCallback

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
    callback.console = TrainConsole(stream=sys.stdout, rich=False)  # the block goes with the summary, to stdout
    targs = TrainingArguments(
        output_dir=str(args.out), per_device_train_batch_size=args.micro, gradient_accumulation_steps=args.accum,
        max_steps=args.steps, learning_rate=1e-2, lr_scheduler_type="constant", logging_steps=1,
        # Trainer's default max_grad_norm=1.0 stays: the callback takes that clipping over and clips with AdaGC
        report_to=[] if args.report_to == "none" else [args.report_to], save_strategy="no",
        train_sampling_strategy="sequential", use_cpu=True, disable_tqdm=True, seed=0,
        run_name=f"hf_trainer seed=0 {time.strftime('%m-%d %H:%M:%S')}")  # tells runs apart in the chart view
    data = samples(args.steps, args.accum, args.micro, args.seq, args.inject_at, args.span, first_step=1)
    print(f"step {args.inject_at}: a garbage document ({args.span} bytes of mojibake) goes into sample 1 of "
          f"micro-batch {args.accum - 1}", flush=True)
    t0 = time.perf_counter()
    trainer = Trainer(model=model, args=targs, train_dataset=data, callbacks=[callback])
    trainer.remove_callback(PrinterCallback)  # Trainer's per-step dicts would bury the spike block
    trainer.train()
    TrainConsole().summary(closing_lines(f"done: {args.steps} steps in {time.perf_counter() - t0:.0f} s",
                                         callback.handle.spikes, args.out))
    return callback


if __name__ == "__main__":
    quiet_backend_noise()  # our command: no MLflow store-creation lines or download bars
    main()
