"""Probes and seconds per localized spike at 1, 2 and 4 processes, every level (issue 27 item 2).

One global batch of ``G`` micro-batch pieces (``B`` rows of ``T`` tokens each) holds one culprit,
the same on every world size: a packed document (``--case document``, rows with ``document_ids``)
or a whole bad sample (``--case sample``). One process localizes the G pieces as G micro-batches
of the global-mean loss; 2 and 4 gloo processes (DDP) each localize their own pieces (G/W
micro-batches per rank). The table: the culprit rows (which must agree), the probes
(forward+backward passes; under DDP each is a collective on every rank), and the wall time per
localization (slowest rank, median of ``--repeats``), as a ratio to one process in the same run.

    python benchmarks/bench_levels_dist.py [--worlds 1 2 4] [--case document|sample] [--repeats 3]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _gloo import run_ranks  # noqa: E402

G, B, T, V = 4, 8, 64, 256
BAD = (3, 5)  # (piece, row) of the culprit


def batch(case: str):
    g = torch.Generator().manual_seed(5)
    x = torch.randint(0, V, (G, B, T), generator=g)
    y = torch.randint(0, V, (G, B, T), generator=g)
    w = torch.ones(G, B, T)
    docs = torch.zeros(G, B, T, dtype=torch.long)
    if case == "document":
        docs[BAD][20:44], docs[BAD][44:] = 1, 2
        w[BAD][20:44] = 25.0
    else:
        w[BAD] = 20.0
    return x, y, w, docs


def step(model, case: str, pieces: list[int], norm: float):
    """The step of ``pieces`` after its training backward, as ``locate`` takes it."""
    from gradloc_track.localizer import LocateStep

    x, y, w, docs = batch(case)

    def fn(j):
        def loss_fn(mask):
            per = F.cross_entropy(model(x[j]).reshape(-1, V), y[j].reshape(-1), reduction="none").view(B, T)
            return (per * w[j] * mask).sum() / norm
        return loss_fn

    fns, masks = [fn(j) for j in pieces], [torch.ones(B, T) for _ in pieces]
    for f, m in zip(fns, masks):
        f(m).backward()
    packed = [docs[j] if case == "document" else None for j in pieces]
    return LocateStep(fns if len(fns) > 1 else fns[0], masks if len(masks) > 1 else masks[0],
                      document_ids=(packed if len(packed) > 1 else packed[0]) if case == "document" else None)


def build():
    from gradloc_track.demo.model import TinyGPT

    torch.manual_seed(0)
    return TinyGPT(vocab_size=V, n_layer=2, n_head=2, d_model=32, max_seq_len=T)


def measure(model, located, world: int, repeats: int) -> tuple[list, int, float]:
    import gradloc_track

    times, res = [], None
    for _ in range(repeats):
        if world > 1:
            dist.barrier()
        t0 = time.perf_counter()
        res = gradloc_track.locate(model, located)
        elapsed = torch.tensor([time.perf_counter() - t0])
        if world > 1:
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's time
        times.append(float(elapsed))
    k = G // world
    rows = sorted((c.level, (c.rank or 0) * k + (c.micro_batch or 0), c.batch, c.document, round(c.share, 3))
                  for c in res.culprits)
    return rows, res.probes, statistics.median(times)


def worker(rank: int, world: int, args) -> tuple:
    """One rank (inside its gloo group, ``_gloo.run_ranks``): what rank 0 reports."""
    from torch.nn.parallel import DistributedDataParallel

    model = build()
    k = G // world
    located = step(DistributedDataParallel(model), args.case, [rank * k + i for i in range(k)], k * B * T)
    return measure(model, located, world, args.repeats)


def run_world(world: int, args) -> tuple:
    if world == 1:
        torch.set_num_threads(1)
        model = build()
        return measure(model, step(model, args.case, list(range(G)), G * B * T), 1, args.repeats)
    return run_ranks(world, worker, args)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--case", choices=["document", "sample"], default="document")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    results = {w: run_world(w, args) for w in args.worlds}
    base = results[args.worlds[0]][2]
    print(f"\nlocate(), one {args.case} culprit in a global batch of {G} x {B} rows x {T} tokens; DDP on gloo "
          "for 2+ processes, 1 thread per process")
    print(f"{'processes':>10}{'probes':>8}{'seconds':>9}{'vs 1st':>8}  "
          "culprit rows (level, piece, row, document, share)")
    for w, (rows, probes, secs) in results.items():
        print(f"{w:>10}{probes:>8}{secs:>9.3f}{secs / base:>7.2f}x  {rows}")
    same = len({tuple(r) for r, _, _ in results.values()}) == 1
    print("the culprit rows agree on every world size" if same else "THE CULPRIT ROWS DIFFER")


if __name__ == "__main__":
    main()
