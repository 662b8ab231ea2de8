"""What a localized spike costs: probes, end-to-end time in NORMAL STEPS, and peak extra memory in
GRADIENT SIZES, for ``gradloc`` (GradLoc's procedure), ``bisect`` (ours) and ``auto``, for N loss
terms and m culprits, against a baseline measured in the same run.

One model, the same batches for every method. Culprits are loss terms with a large weight (an
importance ratio gone wild) growing with sqrt(N), so that GradLoc's rule can see them at all (it
prunes a range holding a culprit smaller than sqrt(size) times the threshold). ``gradloc`` gets
the threshold ``auto`` chose, so all three look for the same thing; recall is against the
injected set, over every term the search found: culprits and the rows under the share floor (in
parentheses: with many culprits in unrelated directions a few carry ~0 or a negative share of
the step, and are not shown as culprits).

- normal step: ``zero_grad`` + forward + backward of the whole batch (what training pays anyway),
  the step's gradient left in ``.grad`` as in training;
- time: CPU seconds of this process (one torch thread: other processes on a shared machine move
  wall time, not this); each round is 3 normal steps, locate, 3 normal steps, and its ratio is
  locate over the mean of the two medians around it; ``steps`` = the median ratio over rounds,
  ``steps - probes`` = what is not a probe's forward+backward (the goal: a localized spike costs
  at most probes + 1 normal steps); ``outside probes`` = the part of the locate spent outside
  ``Prober.probe`` (forward+backward of each probe), in normal steps: what is not a probe,
  whatever a probe costs against a normal step in that round;
- memory: peak tensor bytes held by ``locate`` beyond one plain forward+backward of the batch
  (``TensorMemoryMeter``), in gradient sizes (the goal for ``auto`` is <= 1.1).

    python benchmarks/bench_locate.py [--terms 1024] [--culprits 1 8 32] [--rounds 3]
                                      [--memory-terms 256 1024]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import gradloc_track
from gradloc_track.demo.model import TinyGPT
from gradloc_track.tensor_memory import TensorMemoryMeter

V = 64
METHODS = ("gradloc", "bisect", "auto")


def case(model, n_terms: int, m: int, seed: int, weight: float | None = None):
    T = 512 if n_terms >= 512 else n_terms
    B = n_terms // T
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, V, (B, T), generator=g)
    y = torch.randint(0, V, (B, T), generator=g)
    w = torch.ones(B, T)
    flat = torch.randperm(B * T, generator=g)[:m]
    culprits = {(int(i) // T, int(i) % T) for i in flat}
    for b, t in culprits:
        # GradLoc's regime: a culprit must out-grow sqrt(N) ordinary terms for its bisection to see it
        w[b, t] = weight if weight is not None else 10.0 * n_terms ** 0.5

    def loss_fn(mask):
        per = F.cross_entropy(model(x).reshape(-1, V), y.reshape(-1), reduction="none").view(B, T)
        return (per * w * mask).sum() / (B * T)

    return loss_fn, torch.ones(B, T), culprits


def below(res) -> list:
    return getattr(res, "below_floor", [])  # (an older localizer has no share floor)


def found_terms(res) -> set:
    """Every term the search found: culprits and rows under the share floor."""
    return {(c.batch, c.position) for c in res.tokens + below(res) if c.level == "token"}


class ProbeClock:
    """CPU seconds spent inside ``Prober.probe`` (forward + backward of a probe and its own
    bookkeeping), so a locate's time splits into probes and everything else."""

    def __init__(self) -> None:
        from gradloc_track.localizer.probe import Prober

        self.seconds, original = 0.0, Prober.probe

        def timed(prober, *args, **kwargs):
            t0 = time.process_time()
            try:
                return original(prober, *args, **kwargs)
            finally:
                self.seconds += time.process_time() - t0

        Prober.probe = timed


def normal_step(model, loss_fn, mask) -> float:
    t0 = time.process_time()
    model.zero_grad(set_to_none=True)
    loss_fn(mask).backward()  # the step's gradient stays in .grad, as in training
    return time.process_time() - t0


def cost_table(model, n_terms: int, culprit_counts, rounds: int, budget: int, methods=METHODS,
               clock: ProbeClock | None = None) -> None:
    clock = clock or ProbeClock()
    print(f"\n1. cost of a localized spike, N={n_terms} terms (normal step = zero_grad + forward + backward; "
          "CPU time)")
    print("| m | method | probes | recall (below floor) | normal step ms | locate ms | steps | steps - probes | "
          "outside probes |")
    print("|---|---|---|---|---|---|---|---|---|")
    ratios = []
    for m in culprit_counts:
        loss_fn, mask, truth = case(model, n_terms, m, seed=n_terms + m)
        normal_step(model, loss_fn, mask)
        tau, row, rec = None, {}, {}
        for method in [m for m in ("auto", "bisect", "gradloc") if m in methods]:
            steps, locs, ratios_m, others = [], [], [], []
            for r in range(rounds):
                before = statistics.median(normal_step(model, loss_fn, mask) for _ in range(3))
                in_probes = clock.seconds
                t0 = time.process_time()
                res = gradloc_track.locate(model, loss_fn, mask, method=method, budget=budget,
                                           threshold=tau if method == "gradloc" else None)
                locs.append(time.process_time() - t0)
                after = statistics.median(normal_step(model, loss_fn, mask) for _ in range(3))
                steps += [before, after]
                ratios_m.append(2 * locs[-1] / (before + after))
                others.append(2 * (locs[-1] - (clock.seconds - in_probes)) / (before + after))
            tau = res.threshold if method == "auto" else tau
            found = found_terms(res)
            row[method], rec[method] = res.probes, len(found & truth) / len(truth)
            ratio = statistics.median(ratios_m)
            print(f"| {m} | {method} | {res.probes} | {rec[method]:.2f} ({len(below(res))}) | "
                  f"{statistics.median(steps) * 1e3:.1f} | "
                  f"{statistics.median(locs) * 1e3:.1f} | {ratio:.2f} | {ratio - res.probes:+.2f} | "
                  f"{statistics.median(others):.2f} |"
                  + (" (budget exhausted)" if res.budget_exhausted else ""))
        if "auto" in rec and "gradloc" in rec and rec["auto"] == rec["gradloc"]:
            ratios.append(row["auto"] / row["gradloc"])
    if ratios:
        print(f"\nauto/gradloc probes at equal recall: max {max(ratios):.3f}, mean {sum(ratios) / len(ratios):.3f}"
              f" over {len(ratios)} cases")


def memory_table(model, sizes) -> None:
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"\n2. peak extra memory of locate, in gradient sizes ({grad_bytes / 2**20:.2f} MiB), over one plain "
          "forward+backward")
    print("| N (B x T) | m | method | probes | found | extra |")
    print("|---|---|---|---|---|---|")
    for n in sizes:
        tau = None
        for m in (1, 32):
            loss_fn, mask, truth = case(model, n, m, seed=7, weight=200.0)
            normal_step(model, loss_fn, mask)  # the step's own gradients exist, as in training
            with TensorMemoryMeter() as base:
                saved = [p.grad for p in model.parameters()]
                model.zero_grad(set_to_none=True)
                loss_fn(mask).backward()
                for p, g in zip(model.parameters(), saved):
                    p.grad = g
            for method in ("auto", "bisect", "gradloc"):
                with TensorMemoryMeter() as meter:
                    res = gradloc_track.locate(model, loss_fn, mask, method=method, budget=2000, threshold=tau)
                tau = res.threshold  # the adaptive threshold of the first run serves every later one
                extra = (meter.peak - base.peak) / grad_bytes
                found = found_terms(res)
                shape = f"{n} ({mask.shape[0]} x {mask.shape[1]})"
                print(f"| {shape} | {m} | {method} | {res.probes} | {len(found & truth)} | {extra:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--terms", type=int, default=1024)
    ap.add_argument("--culprits", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--budget", type=int, default=2000)
    ap.add_argument("--memory-terms", type=int, nargs="*", default=[256, 1024])
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    args = ap.parse_args()
    torch.set_num_threads(1)  # 2 shared cores: one thread times steadier than two fighting
    torch.manual_seed(0)
    model = TinyGPT(vocab_size=V, n_layer=2, n_head=2, d_model=32, max_seq_len=512)
    cost_table(model, args.terms, args.culprits, args.rounds, args.budget, args.methods, ProbeClock())
    if args.memory_terms:
        memory_table(model, args.memory_terms)


if __name__ == "__main__":
    main()
