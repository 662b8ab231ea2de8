"""SFT with TRL's ``SFTTrainer(packing=True)`` and gradloc-track's callback: CPU, offline, one bad document.

    python examples/trl_sft_packing.py                   # TRL's MLflow run in ./mlflow.db
    python examples/trl_sft_packing.py --report-to none  # local files under --out only

A tiny random-init GPT-2 learns short documents (the alphabet from a random letter on), packed into rows of
``--max-length`` tokens (TRL's default BFD packing: padding-free, each micro-batch one row whose
``position_ids`` restart at every document). One document is mojibake (``â€™Ã©...``); its packed
row is moved to step ``--inject-at``. The callback sees the spike and names the DOCUMENT inside
the packed row (the ``document`` column of the token table, the console block, a block of its
own on the highlight page), not the row, which holds several unrelated documents. The console is the
script's stdout; each run writes to a new ``runs/trl_sft_packing/<date>_<time>``.
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
from gradloc_track.demo.extras import need
from gradloc_track.demo.out_dir import run_dir_for
from gradloc_track.demo.threads import set_threads
from gradloc_track.trackers.quiet import quiet_backend_noise

MOJIBAKE = "â€™" * 4  # 12 characters the model never saw, in a document of its own


CHAR_VOCAB = 40


def documents(n: int, seed: int = 0) -> list[str]:
    """``n`` documents a tiny model learns in a few dozen steps: the alphabet from a random letter on
    ("qrstuvwxyzabc..."), 20-80 letters long, so that one corrupted document stands out later as
    it would in a trained model."""
    g = torch.Generator().manual_seed(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    out = []
    for _ in range(n):
        start, length = (int(x) for x in (torch.randint(0, 26, (1,), generator=g), torch.randint(20, 81, (1,),
                                                                                                generator=g)))
        out.append("".join(letters[(start + i) % 26] for i in range(length)))
    return out


def move_row_to_step(trainer, marker: list[int], step: int) -> dict:
    """Put the packed row holding ``marker`` (the bad document's ids) first in step ``step``'s rows; returns
    where the bad document sits: {"step", "document" (its index in the step's flattened micro-batch), "ids"}."""
    ds = trainer.train_dataset
    rows_per_step = trainer.args.per_device_train_batch_size * trainer.args.gradient_accumulation_steps
    hit = next(i for i, ids in enumerate(ds["input_ids"]) if _find(ids, marker) >= 0)
    order = [i for i in range(len(ds)) if i != hit]
    first = (step - 1) * rows_per_step  # Trainer logs update s at global_step s (its first is 1)
    order.insert(first, hit)
    trainer.train_dataset = ds.select(order)
    # the step's first micro-batch is rows first .. first+per_device-1, flattened into one row (padding-free)
    micro = trainer.train_dataset.select(range(first, first + trainer.args.per_device_train_batch_size))
    lengths = [n for row in micro["seq_lengths"] for n in row]
    flat = [t for row in micro["input_ids"] for t in row]
    start = _find(flat, marker)
    starts = [sum(lengths[:k]) for k in range(len(lengths))]
    doc = max(k for k, s in enumerate(starts) if s <= start)
    return {"step": step, "document": doc, "start": starts[doc], "end": starts[doc] + lengths[doc]}


def _find(seq: list[int], sub: list[int]) -> int:
    n = len(sub)
    return next((i for i in range(len(seq) - n + 1) if seq[i:i + n] == sub), -1)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--inject-at", type=int, default=50)
    ap.add_argument("--max-length", type=int, default=128, help="packed row length")
    ap.add_argument("--rows", type=int, default=2, help="per_device_train_batch_size (packed rows per step)")
    ap.add_argument("--report-to", default="mlflow", choices=["mlflow", "wandb", "none"])
    ap.add_argument("--out", default=None, help="the run dir (default: a new runs/trl_sft_packing/<date>_<time>)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: half the cores, at most 4)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None):
    args = parse_args(argv)
    need("transformers", "trl", "datasets", "tokenizers")  # pip install 'gradloc-track[examples]'
    try:
        args.out = run_dir_for(args.out, "trl_sft_packing")
    except ValueError as exc:
        sys.exit(f"error: {exc}")
    set_threads(args.threads)
    warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")  # their deprecations
    from datasets import Dataset
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.trainer_callback import PrinterCallback
    from trl import SFTConfig, SFTTrainer

    from gradloc_track.demo.tokenizer import BpeTokenizer
    from gradloc_track.integrations.trl import GradLocCallback

    # characters as tokens (the BPE trainer left no room for merges): 26 letters, the specials, the mojibake
    bpe = BpeTokenizer.train_or_load(" ".join(documents(400, seed=1)), CHAR_VOCAB)
    tok = bpe.to_transformers()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(
        vocab_size=bpe.vocab_size, n_positions=args.max_length, n_embd=64, n_layer=2, n_head=2, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=tok.pad_token_id, eos_token_id=tok.pad_token_id,
        pad_token_id=tok.pad_token_id))
    os.environ.setdefault("MLFLOW_EXPERIMENT_NAME", "gradloc-track-trl")
    if args.report_to == "mlflow":
        os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{Path.cwd() / 'mlflow.db'}")
    # detector settings for a 60-step run: a short memory, and the ratio rule at 2.5x (the defaults assume
    # hundreds of steps)
    callback = GradLocCallback(spikes={"warmup_steps": 15, "alpha": 0.9, "ratio_thresh": 2.5},  # <- gradloc-track
                               tokenizer=bpe, run_dir=args.out)
    callback.console = TrainConsole(stream=sys.stdout, rich=False)  # the block goes with the summary, to stdout
    config = SFTConfig(
        output_dir=str(args.out), packing=True, max_length=args.max_length, per_device_train_batch_size=args.rows,
        max_steps=args.steps, learning_rate=1e-2, lr_scheduler_type="constant", logging_steps=1,
        report_to=[] if args.report_to == "none" else [args.report_to], save_strategy="no",
        train_sampling_strategy="sequential", use_cpu=True, disable_tqdm=True, bf16=False, seed=0,
        run_name=f"trl_sft_packing seed=0 {time.strftime('%m-%d %H:%M:%S')}")  # apart in the chart view
    docs = documents(6 * args.rows * args.steps)
    docs.insert(len(docs) // 2, MOJIBAKE)
    trainer = SFTTrainer(model=model, args=config, train_dataset=Dataset.from_dict({"text": docs}),
                         processing_class=tok, callbacks=[callback])
    injected = move_row_to_step(trainer, bpe.encode(MOJIBAKE), args.inject_at)
    trainer.remove_callback(PrinterCallback)  # Trainer's per-step dicts would bury the spike block
    print(f"injected: step {injected['step']}, document {injected['document']} "
          f"(positions {injected['start']}-{injected['end'] - 1} of the packed micro-batch): {MOJIBAKE!r}",
          flush=True)
    t0 = time.perf_counter()
    trainer.train()
    TrainConsole().summary(closing_lines(f"done: {args.steps} steps in {time.perf_counter() - t0:.0f} s",
                                         callback.handle.spikes, args.out))
    return callback, injected

if __name__ == "__main__":
    quiet_backend_noise()  # our command: no MLflow store-creation lines or download bars
    main()
