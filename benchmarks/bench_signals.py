"""What the detector's signals beyond the gradient norms cost per step (issue 26), on bench_monitor's
4-layer d=256 GPT (batch 4x256, AdamW), CPU.

Variants, each a whole training step (fwd + bwd + AdamW), measured interleaved against the same
plain step, round-robin:

- ``watch(), 0.3's signals``: ``gradloc_track.watch(model, opt)`` with the new signals off
  (``loss_signal``, ``sample_signal``, ``update_signal``, ``junk_signal`` false, ``noise_floor`` 0);
- ``watch(), + loss``: the model's own loss (read from the forward's output: free);
- ``watch(), + update``: the update Adam is about to make (``<exp_avg, g>`` each step; ``||exp_avg||^2``
  and ``sum exp_avg_sq`` carried by Adam's recursions, read whole every 16 steps);
- ``watch(), + update, read whole``: the same, reading ``exp_avg`` and ``exp_avg_sq`` whole every step
  (the update signal before carrying: ``AdamUpdate.resync = 1``);
- ``watch(), + sample losses``: each sample's mean loss (a no-grad cross-entropy pass over the logits);
- ``watch(), + junk span``: each term's excess over chance (``mean(logits) - logit of the target``, one
  reduction over the vocabulary) and its largest 16-term run;
- ``watch(), defaults``: all of them.

Every variant logs every step (``log_every=1``) with the detector armed and the localizer off (a chance
spike must not land in the timing). Reported: the median of per-pair ratios against the plain step,
and the difference to ``0.3's signals`` (what the new signals add).

    python benchmarks/bench_signals.py [--rounds 30] [--batch 4] [--seq 256] [--threads N]
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gradloc_track  # noqa: E402
from gradloc_track import MemoryTracker  # noqa: E402
from gradloc_track.demo.model import TinyGPT  # noqa: E402

OFF = {"loss_signal": False, "sample_signal": False, "update_signal": False, "junk_signal": False, "noise_floor": 0.0}
VARIANTS = {
    "watch(), 0.3's signals": OFF,
    "watch(), + loss": {**OFF, "loss_signal": True},
    "watch(), + update": {**OFF, "update_signal": True},
    "watch(), + update, read whole": {**OFF, "update_signal": True},
    "watch(), + sample losses": {**OFF, "sample_signal": True},
    "watch(), + junk span": {**OFF, "junk_signal": True},
    "watch(), defaults": {},
}


class LM(torch.nn.Module):
    """TinyGPT called the HF way, ``model(input_ids=, labels=)`` returning ``.loss`` and ``.logits``."""

    def __init__(self, gpt: TinyGPT) -> None:
        super().__init__()
        self.gpt = gpt

    def forward(self, input_ids, labels=None):
        logits = self.gpt(input_ids)  # (B, T, V)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
        return type("Out", (), {"loss": loss, "logits": logits})()


def make_step(model, opt, pool):
    def step(i: int) -> None:
        ids = pool[i % len(pool)]
        opt.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()

    return step


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    proto = LM(TinyGPT(vocab_size=256, n_layer=4, n_head=4, d_model=256, max_seq_len=args.seq))
    gen = torch.Generator().manual_seed(1)
    pool = [torch.randint(0, 256, (args.batch, args.seq), generator=gen) for _ in range(16)]
    plain_model = copy.deepcopy(proto)
    plain = make_step(plain_model, torch.optim.AdamW(plain_model.parameters(), lr=1e-4), pool)
    steps, handles = {}, []
    for name, spikes in VARIANTS.items():
        model = copy.deepcopy(proto)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        handles.append(gradloc_track.watch(model, opt, tracker=MemoryTracker(), log_every=1, locate=False,
                                           spikes=spikes))
        if name.endswith("read whole"):
            handles[-1].monitor.detector_inputs.adam.resync = 1
        steps[name] = make_step(model, opt, pool)
    for i in range(3):  # warm-up: allocator, Adam state
        plain(i)
        for fn in steps.values():
            fn(i)
    ratios: dict[str, list[float]] = {k: [] for k in steps}
    base: list[float] = []
    i = 3
    for r in range(args.rounds):
        for name, fn in (reversed(list(steps.items())) if r % 2 else steps.items()):
            t0 = time.perf_counter()
            plain(i)
            t1 = time.perf_counter()
            fn(i)
            t2 = time.perf_counter()
            base.append(t1 - t0)
            ratios[name].append((t2 - t1) / (t1 - t0))
            i += 1
    n_params = sum(p.numel() for p in proto.parameters())
    print(f"4-layer d=256 GPT ({n_params / 1e6:.2f}M), batch {args.batch}x{args.seq}, torch threads "
          f"{torch.get_num_threads()}, rounds {args.rounds}; plain step {statistics.median(base) * 1e3:.1f} ms")
    ref = statistics.median(ratios["watch(), 0.3's signals"])
    print(f"{'variant':<34}{'ratio':>8}{'vs 0.3 signals':>16}")
    for name, rs in ratios.items():
        med = statistics.median(rs)
        print(f"{name:<34}{med:>8.3f}{med - ref:>+16.3f}")
    events = {name: len(h.spikes) for name, h in zip(VARIANTS, handles)}
    print(f"events (random tokens: none expected): {events}")
    for h in handles:
        h.finish()


if __name__ == "__main__":
    main()
