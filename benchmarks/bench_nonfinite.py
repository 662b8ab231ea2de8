"""Probes and seconds of the non-finite search (``localizer/nonfinite.py``) for k NaN samples among n.

Two kinds of NaN step on the same model and batches:
- ``gradient``: a huge advantage on a surrogate whose value is 0 (finite loss, Inf/NaN gradient):
  found by isfinite halving over the samples, then over the named samples' terms;
- ``loss``: ``-log`` of a probability that underflows to 0 (loss Inf, gradient NaN, and NaN in
  every probe through the mask): named from the term-loss map.
Baseline, same run: one plain forward+backward of the batch (``step``) and the brute-force
oracle (one forward+backward per sample alone); ``found`` checks the search against the injected set.

    python benchmarks/bench_nonfinite.py [--sizes 16 64] [--bad 1 2 4] [--threads 1]
"""
from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn.functional as F

import gradloc_track
from gradloc_track.demo.model import TinyGPT

V, T = 64, 32


def per_token(model, x, y, kind: str, bad: list[tuple[int, int]]) -> torch.Tensor:
    logits = model(x)
    if kind == "loss":
        bias = torch.zeros_like(logits)
        for r, t in bad:
            bias[r, t, y[r, t]] = -1e4
        return -torch.log((logits + bias).softmax(-1).gather(-1, y[..., None])[..., 0])
    per = F.cross_entropy(logits.reshape(-1, V), y.reshape(-1), reduction="none").view(y.shape)
    huge = torch.zeros_like(per)
    for r, t in bad:
        huge[r, t] = 1e30
    lp = -per
    return per + (lp - lp.detach()) * huge * huge  # value 0, gradient Inf


def case(n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randint(0, V, (n, T), generator=g), torch.randint(0, V, (n, T), generator=g)
    rows = torch.randperm(n, generator=g)[:k].tolist()
    bad = [(r, int(torch.randint(0, T, (1,), generator=g))) for r in rows]
    return x, y, bad


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run_one(model, n: int, k: int, kind: str, seed: int) -> dict:
    x, y, bad = case(n, k, seed)

    def loss_fn(mask):
        return (per_token(model, x, y, kind, bad) * mask).sum() / x.numel()

    mask = torch.ones(n, T)
    model.zero_grad(set_to_none=True)
    step_s = timed(lambda: loss_fn(mask).backward())
    t0 = time.perf_counter()
    result = gradloc_track.locate(model, loss_fn, mask, budget=512)
    seconds = time.perf_counter() - t0

    def brute():
        for r in range(n):
            model.zero_grad(set_to_none=True)
            (per_token(model, x[r:r + 1], y[r:r + 1], kind, [(0, t) for rr, t in bad if rr == r]).sum()
             / x.numel()).backward()
    oracle_s = timed(brute)
    model.zero_grad(set_to_none=True)
    f = result.nonfinite
    return {"n": n, "k": k, "kind": kind, "found": set(f.samples) == {r for r, _ in bad},
            "terms": set(f.terms) == set(bad), "search_probes": f.probes, "probes": result.probes,
            "bound": 2 * k * math.log2(n), "term_bound": 2 * k * math.log2(T), "seconds": seconds, "step_s": step_s,
            "oracle_s": oracle_s}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--bad", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = TinyGPT(vocab_size=V, n_layer=2, n_head=2, d_model=64, max_seq_len=T)
    run_one(model, 4, 1, "gradient", args.seed)  # warm-up: first-call costs out of the table
    rows = [run_one(model, n, k, kind, args.seed) for kind in ("gradient", "loss") for n in args.sizes
            for k in args.bad if k <= n]
    print(f"TinyGPT 2x64, T={T}, {args.threads} thread(s); probes are full-batch forward+backward passes")
    print("| NaN from | samples n | bad k | named right | terms right | search probes | 2k log2 n + 2k log2 T "
          "| all probes | seconds | x one step | brute force, rows alone (s) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['kind']} | {r['n']} | {r['k']} | {'yes' if r['found'] else 'NO'} | "
              f"{'yes' if r['terms'] else 'NO'} | {r['search_probes']} | {r['bound']:.0f} + {r['term_bound']:.0f} | "
              f"{r['probes']} | {r['seconds']:.3f} | {r['seconds'] / r['step_s']:.1f} | {r['oracle_s']:.3f} |")
    return rows


if __name__ == "__main__":
    main()
