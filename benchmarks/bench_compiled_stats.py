"""Would compiling the detector's per-step statistics pay on a CPU? (issue 38, "fused kernels")

``watch()``'s forward hook turns each micro-batch's logits into the sample and junk signals' inputs
(``integrations/step_losses.detector_losses``): a ``log_softmax`` and a sum over the vocabulary, then about 50
small ops over (B, T) tensors. On the 2-layer d=64 model those small ops are most of the hook's cost. This
script writes the same statistics as one graph-friendly function (``fused``: no host reads, no Python branches
on values), checks that it gives the library's values (1e-5 eager, 1e-4 compiled), and times, interleaved in one
run. ``fused`` does less than the library: finite logits only (no vocabulary mask), no packed documents, no
saved-log-probs route (the logits are read), and neither the junk run's place nor each row's windows and leaked
share, so the comparison flatters the compiled side.

- ``library``: ``detector_losses`` as ``watch()`` calls it on a model that returns logits only (eager);
- ``fused eager``: the graph-friendly function, eager;
- ``fused compiled``: the same under ``torch.compile`` (inductor's C++ kernels; compile time printed apart);
- ``cross-entropy fwd``: ``F.cross_entropy`` on the same logits, the yardstick of a logits pass.

    python benchmarks/bench_compiled_stats.py [--rounds 200] [--threads 1] [--big]

``--big`` adds 1 x 512 x 32000 logits (a real vocabulary; a few minutes with its compile).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _timing import interleaved  # noqa: E402

from gradloc_track.integrations.step_losses import detector_losses  # noqa: E402
from gradloc_track.spikes.junk import LEAK_MIN_TERMS  # noqa: E402

IGNORE = -100


def fused(logits: torch.Tensor, tgt: torch.Tensor, inp: torch.Tensor, terms: int = 16):
    """The largest row mean, each row's mean, the junk span's largest window mean, the mean excess and the
    largest leaked share: what ``detector_losses`` gives for finite logits and unpacked rows, as one graph."""
    valid = tgt != IGNORE
    t = tgt.clamp(min=0)[..., None]
    z = logits.float()
    loss = -torch.log_softmax(z, -1).gather(-1, t)[..., 0]
    excess = z.mean(-1) - z.gather(-1, t)[..., 0]
    count = valid.sum(1)
    n = count.sum().clamp(min=1)
    repeat = valid & (tgt == inp)
    per = loss.masked_fill(~valid, 0.0)
    per = torch.where(repeat, torch.minimum(per, per.sum() / n), per)
    rows = (per.sum(1) / count.clamp(min=1)).masked_fill(count == 0, -torch.inf)
    ex = torch.where(repeat, excess.clamp(max=0.0), excess).masked_fill(~valid, 0.0)
    windows = (ex.unfold(-1, terms, 1).sum(-1) / terms).masked_fill((~valid).unfold(-1, terms, 1).any(-1), -torch.inf)
    prev = torch.cat([inp[:, :1] - 1, inp[:, :-1]], 1)
    fresh = inp != prev
    c2 = (valid & fresh).sum(1)
    leak = ((repeat & fresh).sum(1) / c2.clamp(min=1)).masked_fill(c2 < LEAK_MIN_TERMS, 0.0)
    return rows.max(), rows, windows.max(), ex.sum() / n, leak.max()


def case(B: int, T: int, V: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g)
    ids = torch.randint(0, V, (B, T + 1), generator=g)
    inp, tgt = ids[:, :-1].clone(), ids[:, 1:].clone()
    tgt[:, -1] = IGNORE
    return logits, tgt, inp


def run(B: int, T: int, V: int, rounds: int) -> None:
    logits, tgt, inp = case(B, T, V)
    lib = lambda: detector_losses(logits, tgt, inp, None, samples=True, junk_terms=16, with_rows=True)  # noqa: E731
    smax, junk, rows = lib()
    want = (smax, rows, junk.span, junk.mean, junk.leak)
    got = fused(logits, tgt, inp)
    for name, a, b in zip(("largest row", "rows", "junk span", "junk mean", "leak"), want, got):
        torch.testing.assert_close(b, a.float(), rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
    t0 = time.perf_counter()
    compiled = torch.compile(fused, dynamic=False)
    got = compiled(logits, tgt, inp)
    compile_s = time.perf_counter() - t0
    for a, b in zip(want, got):
        torch.testing.assert_close(b, a.float(), rtol=1e-4, atol=1e-4)
    variants = {
        "library (eager)": lib,
        "fused eager": lambda: fused(logits, tgt, inp),
        "fused compiled": lambda: compiled(logits, tgt, inp),
        "cross-entropy fwd": lambda: F.cross_entropy(logits.view(-1, V), tgt.view(-1)),
    }
    seconds = interleaved({k: (lambda i, fn=fn: fn()) for k, fn in variants.items()}, rounds, warmup=1,
                          clock=time.thread_time)
    med = {k: v * 1e3 for k, v in seconds.items()}  # ms
    base = med["library (eager)"]
    print(f"\nlogits {B} x {T} x {V}, torch threads {torch.get_num_threads()}, {rounds} rounds; compile "
          f"{compile_s:.1f} s; values equal to the library's")
    print(f"{'variant':<22}{'thread ms':>11}{'vs library':>12}{'vs CE fwd':>11}")
    for name, t in med.items():
        print(f"{name:<22}{t:>11.3f}{t / base:>12.3f}{t / med['cross-entropy fwd']:>11.2f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--big", action="store_true", help="also 1 x 512 x 32000 logits")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    run(4, 256, 256, args.rounds)  # the 2-layer d=64 bench's micro-batch
    if args.big:
        run(1, 512, 32000, max(10, args.rounds // 20))


if __name__ == "__main__":
    main()
