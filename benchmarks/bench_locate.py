"""Probes and wall time of ``bisect`` (GradLoc) vs ``auto``, for N loss terms and m culprits.

One run, one model, the same batches for both methods. Culprits are injected as loss terms with
a large weight (an importance ratio gone wild), growing with sqrt(N) so that GradLoc's bisection
can see them at all (its root split prunes a culprit smaller than sqrt(N) ordinary terms). Recall
is checked against the injected set; the probe ratio is reported where both recalls are equal.

    python benchmarks/bench_locate.py [--sizes 512 4096 32768] [--culprits 1 4]
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import gradloc_track
from gradloc_track.demo.model import TinyGPT

V = 64


def case(model, n_terms: int, m: int, seed: int):
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
        w[b, t] = 10.0 * n_terms ** 0.5

    def loss_fn(mask):
        per = F.cross_entropy(model(x).reshape(-1, V), y.reshape(-1), reduction="none").view(B, T)
        return (per * w * mask).sum() / (B * T)

    return loss_fn, torch.ones(B, T), culprits


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="+", default=[512, 4096, 32768])
    ap.add_argument("--culprits", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--budget", type=int, default=512)
    args = ap.parse_args()
    torch.manual_seed(0)
    model = TinyGPT(vocab_size=V, n_layer=2, n_head=2, d_model=32, max_seq_len=512)
    print(f"{'N':>7}{'m':>4}{'method':>8}{'probes':>8}{'seconds':>9}{'recall':>8}{'false+':>8}")
    ratios = []
    for n in args.sizes:
        for m in args.culprits:
            loss_fn, mask, truth = case(model, n, m, seed=n + m)
            row, rec = {}, {}
            for method in ("bisect", "auto"):
                t0 = time.perf_counter()
                res = gradloc_track.locate(model, loss_fn, mask, method=method, budget=args.budget)
                dt = time.perf_counter() - t0
                found = {(c.batch, c.position) for c in res.tokens}
                recall = len(found & truth) / len(truth)
                row[method], rec[method] = res.probes, recall
                print(f"{n:>7}{m:>4}{method:>8}{res.probes:>8}{dt:>9.2f}{recall:>8.2f}{len(found - truth):>8}"
                      + ("  (budget exhausted)" if res.budget_exhausted else ""))
            if rec["auto"] == rec["bisect"]:
                ratios.append(row["auto"] / row["bisect"])
    if ratios:
        print(f"\nauto/bisect probes at equal recall: max {max(ratios):.3f}, mean {sum(ratios) / len(ratios):.3f}"
              f" over {len(ratios)} cases")


if __name__ == "__main__":
    main()
