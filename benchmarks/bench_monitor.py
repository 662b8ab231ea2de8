"""Cost of gradient monitoring per training step, on a 6.2M-parameter GPT on CPU.

Variants, measured interleaved in one run, each against the same plain step (fwd+bwd+AdamW):
the GradMonitor logging every step; a naive per-parameter ``.item()`` loop computing the same
norms; ``wandb.watch(log="gradients", log_freq=1)`` in offline mode.

    python benchmarks/bench_monitor.py [--rounds 20] [--batch 8] [--seq 256]
"""
from __future__ import annotations

import argparse
import copy
import math
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import interleaved, report  # noqa: E402

from gradloc_track import GradMonitor, MemoryTracker  # noqa: E402
from gradloc_track.demo.model import TinyGPT  # noqa: E402


def make_step(model, batch, extra=None, opt=None):
    opt = opt or torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = batch[:, :-1], batch[:, 1:]

    def step(i: int) -> None:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1)).backward()
        if extra is not None:
            extra(i)
        opt.step()

    return step


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--no-wandb", action="store_true")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    proto = TinyGPT(vocab_size=256, n_layer=6, n_head=6, d_model=288, max_seq_len=args.seq)
    n_params = sum(p.numel() for p in proto.parameters())
    batch = torch.randint(0, 256, (args.batch, args.seq + 1))
    # base, monitor and naive share ONE model and optimizer: they differ only by the extra call
    # (separate copies differ by a few % from memory placement alone, which is noise, not cost)
    shared = copy.deepcopy(proto)
    opt = torch.optim.AdamW(shared.parameters(), lr=1e-4)
    models = {"watch": copy.deepcopy(proto), "watch_base": copy.deepcopy(proto)}
    monitor = GradMonitor(shared, tracker=MemoryTracker(), log_every=1)

    def naive(i: int) -> None:
        norms = {n: p.grad.norm().item() for n, p in shared.named_parameters()}  # one sync each
        sum(v * v for v in norms.values()) ** 0.5

    variants = {
        "plain step (baseline)": make_step(shared, batch, opt=opt),
        "GradMonitor, logging every step": make_step(shared, batch, lambda i: monitor.after_backward(i), opt=opt),
        "naive per-parameter .item() loop": make_step(shared, batch, naive, opt=opt),
    }
    run = None
    if not args.no_wandb:
        os.environ.setdefault("WANDB_MODE", "offline")
        os.environ.setdefault("WANDB_SILENT", "true")
        import wandb

        run = wandb.init(project="gradloc-bench", dir=tempfile.mkdtemp(), mode="offline")
        run.watch(models["watch"], log="gradients", log_freq=1)  # hooks stay on that copy
        variants["plain step on a second copy (watch baseline)"] = make_step(
            models["watch_base"], batch, lambda i: run.log({"step": i}))
        variants["wandb.watch(log='gradients', log_freq=1)"] = make_step(
            models["watch"], batch, lambda i: run.log({"step": i}))
    print(f"model: {n_params / 1e6:.1f}M parameters, batch {args.batch}x{args.seq}, "
          f"torch threads {torch.get_num_threads()}, rounds {args.rounds}")
    medians = interleaved(variants, args.rounds)
    report("step time, median of interleaved rounds", medians, "plain step (baseline)")
    if run is not None:
        w, wb = medians["wandb.watch(log='gradients', log_freq=1)"], medians["plain step on a second copy (watch baseline)"]
        print(f"wandb.watch vs its own copy's plain step: {w / wb:.3f}")
    # the monitor call alone, on the gradients the last step left (no model noise around it)
    alone = interleaved({"after_backward alone": lambda i: monitor.after_backward(i)}, 50)
    base = medians["plain step (baseline)"]
    ms = alone["after_backward alone"] * 1e3
    print(f"\nGradMonitor.after_backward alone: {ms:.2f} ms = {ms / (base * 1e3):.2%} of the plain step")
    if run is not None:
        run.finish()


if __name__ == "__main__":
    main()
