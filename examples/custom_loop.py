"""Your own training loop with gradloc-track: per-layer gradient norms, clipping (ZClip), spike
detection, and the text that caused a spike, logged and printed.

    python examples/custom_loop.py                    # files under runs/custom_loop/<date>_<time> (no server)
    python examples/custom_loop.py --tracker mlflow   # ./mlflow.db; prints how to open the run

A small GPT (bytes as tokens, dropout on) learns to complete 8 lines from their prompt (the first
8 positions, no loss term there). At step 100 the answer of sample 3 is garbled text:
the detector fires on that step, the localizer names the garbled tokens, and the spike block is
printed. The lines between the two ``# ---`` markers are the README's "Use it in
your loop"; everything else is the set-up any loop has (model, optimizer, batches).
"""
from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F

from gradloc_track import (GradMonitor, LocateConfig, SpikeArtifactWriter, SpikeContext, SpikeDetector, TrackerConfig,
                           TrainConsole, ZClip, closing_lines, make_tracker, save_rng)
from gradloc_track.demo.data import ByteTokenizer
from gradloc_track.demo.model import TinyGPT
from gradloc_track.demo.out_dir import run_dir_for
from gradloc_track.demo.threads import set_threads
from gradloc_track.trackers.quiet import quiet_backend_noise

LINES = [  # prompt (8 characters, no loss term) -> answer: the model learns to complete each line
    "Q: cat? A: The cat sat on the warm mat all day.  ",
    "Q: dog? A: The dog lay on the rug by the door.   ",
    "Q: owl? A: An owl sang in the old oak at night.  ",
    "Q: sun? A: The sun rose over the quiet hills.    ",
    "Q: sea? A: Waves broke on the grey stone shore.  ",
    "Q: tea? A: She poured tea into two blue cups.    ",
    "Q: map? A: The old map showed a hidden river.    ",
    "Q: bus? A: The night bus was late again today.   ",
]
GARBLED = "zX#q@~!vK%^j&*QwpL0$|Rb}8Tg?yN=+dU_Ck{7s"  # 40 bytes no line has: the whole answer
B, T, PROMPT = len(LINES), len(LINES[0]) - 1, 8  # batch, positions, prompt positions (no loss term)


def get_batch(step: int, tokenizer: ByteTokenizer, inject_at: int) -> tuple[torch.Tensor, ...]:
    """(inputs, targets, loss mask), each (B, T): every line once, in a new order each step; at
    ``inject_at`` the last 40 targets of sample 3 (its whole answer) are garbled text."""
    order = torch.randperm(B, generator=torch.Generator().manual_seed(step)).tolist()
    rows = torch.tensor([tokenizer.encode(LINES[i]) for i in order])  # (B, T+1)
    x, y = rows[:, :-1].clone(), rows[:, 1:].clone()  # (B, T) next-token targets
    mask = torch.ones(B, T)  # (B, T) 1.0 = a loss term
    mask[:, :PROMPT] = 0.0  # the prompt: context, no loss
    if step == inject_at:
        y[3, -len(GARBLED):] = torch.tensor(tokenizer.encode(GARBLED))
    return x, y, mask


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--inject-at", type=int, default=100, help="the step with garbled targets (-1: none)")
    ap.add_argument("--tracker", default="none", choices=["none", "mlflow", "wandb"],
                    help="none: files in the run dir; mlflow: ./mlflow.db; wandb: W&B's own mode (WANDB_MODE)")
    ap.add_argument("--out", default=None, help="the run dir (artifacts, spool, run record; default: a new "
                    "runs/custom_loop/<date>_<time>)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: half the cores, at most 4)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> list[int]:
    """Train; the steps the detector fired on."""
    args = parse_args(argv)
    try:
        out = run_dir_for(args.out, "custom_loop")  # a new dir per run (one run per run dir)
    except ValueError as exc:
        sys.exit(f"error: {exc}")
    set_threads(args.threads)
    torch.manual_seed(0)
    tokenizer = ByteTokenizer()
    model = TinyGPT(vocab_size=256, n_layer=2, n_head=2, d_model=64, max_seq_len=T, dropout=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    run_dir, name = out, f"custom_loop seed=0 {time.strftime('%m-%d %H:%M:%S')}"  # apart in MLflow
    # ---
    console = TrainConsole(stream=sys.stdout)  # prints the spike block
    tracker = make_tracker(TrackerConfig(kind=args.tracker), run_dir=run_dir, run_name=name)
    monitor = GradMonitor(
        model, tracker=tracker, clipper=ZClip(model), optimizer=opt,  # or AdaGC, LayerClip, GlobalClip
        detector=SpikeDetector(), locate_config=LocateConfig(),
        artifact_writer=SpikeArtifactWriter(tracker, run_dir))
    spikes = []  # the GradStats of each step whose spike fired
    for step in range(args.steps):
        x, y, mask = get_batch(step, tokenizer, args.inject_at)  # (B, T) each
        n_tokens = mask.sum()  # the FIXED normaliser: the whole batch's loss-term count

        def loss_fn(keep):  # the loss over the terms ``keep`` selects; the localizer passes parts of mask
            per_token = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="none").view(B, T)
            return (per_token * keep).sum() / n_tokens

        rng = save_rng()  # right before the forward: the localizer's probes replay its dropout
        loss_fn(mask).backward()
        stats = monitor.after_backward(step, spike_context=SpikeContext(
            loss_fn, mask, input_ids=y, tokenizer=tokenizer, rng_state=rng))
        opt.step()  # ZClip clipped the gradients in after_backward
        opt.zero_grad(set_to_none=True)
        if stats.events:  # a spike: the signal, the culprit text, level and share, where the artifacts are
            console.spike(stats, run_dir)
            spikes.append(stats)
    tracker.finish()
    console.summary(closing_lines(f"done: {args.steps} steps", spikes, run_dir))  # and how to look at the run
    # ---
    return [s.step for s in spikes]

if __name__ == "__main__":
    quiet_backend_noise()  # our command: no MLflow store-creation lines or download bars
    main()
