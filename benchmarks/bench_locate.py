"""Probes, wall time and peak extra memory of ``gradloc`` (GradLoc's procedure), ``bisect`` (ours)
and ``auto``, for N loss terms and m culprits.

One run, one model, the same batches for every method. Culprits are injected as loss terms with
a large weight (an importance ratio gone wild), growing with sqrt(N) so that GradLoc's rule can
see them at all (it prunes a range holding a culprit smaller than sqrt(size) times the
threshold). ``gradloc`` needs an explicit threshold: it gets the one ``auto`` chose adaptively,
so all three look for the same thing. Recall is checked against the injected set.

Memory: peak tensor bytes held by ``locate`` beyond one plain forward+backward of the batch,
in gradient sizes (``TensorMemoryMeter``), with 1 and 32 culprits.

    python benchmarks/bench_locate.py [--sizes 512 4096 32768] [--culprits 1 4]
"""
from __future__ import annotations

import argparse
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


def probes_table(model, sizes, culprit_counts, budget) -> None:
    print(f"{'N':>7}{'m':>4}{'method':>9}{'probes':>8}{'seconds':>9}{'recall':>8}{'false+':>8}")
    ratios = []
    for n in sizes:
        for m in culprit_counts:
            loss_fn, mask, truth = case(model, n, m, seed=n + m)
            row, rec, tau = {}, {}, None
            for method in ("auto", "bisect", "gradloc"):
                t0 = time.perf_counter()
                res = gradloc_track.locate(model, loss_fn, mask, method=method, budget=budget,
                                           threshold=tau if method == "gradloc" else None)
                dt = time.perf_counter() - t0
                tau = res.threshold if method == "auto" else tau
                found = {(c.batch, c.position) for c in res.tokens}
                row[method], rec[method] = res.probes, len(found & truth) / len(truth)
                print(f"{n:>7}{m:>4}{method:>9}{res.probes:>8}{dt:>9.2f}{rec[method]:>8.2f}{len(found - truth):>8}"
                      + ("  (budget exhausted)" if res.budget_exhausted else ""))
            if rec["auto"] == rec["gradloc"]:
                ratios.append(row["auto"] / row["gradloc"])
    if ratios:
        print(f"\nauto/gradloc probes at equal recall: max {max(ratios):.3f}, mean {sum(ratios) / len(ratios):.3f}"
              f" over {len(ratios)} cases")


def memory_table(model, n_terms: int) -> None:
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"\npeak extra memory of locate, in gradient sizes ({grad_bytes / 2**20:.2f} MiB), N={n_terms}")
    print(f"{'m':>4}{'method':>9}{'probes':>8}{'found':>7}{'extra':>8}   (found = injected culprits found)")
    tau = None
    for m in (1, 32):
        loss_fn, mask, truth = case(model, n_terms, m, seed=7, weight=200.0)
        model.zero_grad(set_to_none=True)
        loss_fn(mask).backward()  # the step's own gradients exist, as in training
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
            found = {(c.batch, c.position) for c in res.tokens}
            print(f"{m:>4}{method:>9}{res.probes:>8}{len(found & truth):>7}{extra:>8.2f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="+", default=[512, 4096, 32768])
    ap.add_argument("--culprits", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--memory-terms", type=int, default=256)
    args = ap.parse_args()
    torch.manual_seed(0)
    model = TinyGPT(vocab_size=V, n_layer=2, n_head=2, d_model=32, max_seq_len=512)
    probes_table(model, args.sizes, args.culprits, args.budget)
    memory_table(model, args.memory_terms)


if __name__ == "__main__":
    main()
