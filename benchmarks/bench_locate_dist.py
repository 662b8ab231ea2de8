"""Distributed localization: ``auto`` vs GradLoc's procedure on 2 and 4 gloo processes (DDP).

Each rank holds its own batch (B x T loss terms); ``m`` culprits (loss terms with a large weight,
growing with sqrt(N) so GradLoc's bisection can see them) are placed on DIFFERENT ranks,
round-robin from the last rank. Both methods run on the same batches, interleaved, in the same
process group; the table reports probes (forward+backward passes, each a collective on every
rank), wall time (slowest rank, median of ``--repeats``), recall against the placed culprits and
false positives. GradLoc follows one path through the ranks, so it finds one rank's culprits;
it needs an explicit threshold (a quarter of auto's adaptive one, see ``worker``).

    python benchmarks/bench_locate_dist.py [--worlds 2 4] [--culprits 1 3] [--terms 1024]
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

V, T = 64, 256
METHODS = ("gradloc", "auto")


def case(model, rank: int, world: int, n_local: int, m: int):
    """This rank's loss_fn and mask, and the placed culprits (identical on every rank)."""
    B = n_local // T
    g = torch.Generator().manual_seed(1000 * world + m)
    x = torch.randint(0, V, (world, B, T), generator=g)
    y = torch.randint(0, V, (world, B, T), generator=g)
    culprits = set()
    for i in range(m):  # different ranks, round-robin from the last one
        r = (world - 1 - i) % world
        culprits.add((r, int(torch.randint(0, B, (1,), generator=g)), int(torch.randint(0, T, (1,), generator=g))))
    w = torch.ones(B, T)
    for r, b, t in culprits:
        if r == rank:
            w[b, t] = 10.0 * (n_local * world) ** 0.5
    xr, yr = x[rank], y[rank]

    def loss_fn(mask):
        per = F.cross_entropy(model(xr).reshape(-1, V), yr.reshape(-1), reduction="none").view(B, T)
        return (per * w * mask).sum() / (B * T)

    return loss_fn, torch.ones(B, T), culprits


def worker(rank: int, world: int, args) -> list:
    """One rank (inside its gloo group, ``_gloo.run_ranks``): the rows rank 0 reports."""
    import gradloc_track
    from gradloc_track.demo.model import TinyGPT
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = TinyGPT(vocab_size=V, n_layer=2, n_head=2, d_model=32, max_seq_len=T)
    ddp = DistributedDataParallel(model)
    rows = []
    for m in args.culprits:
        loss_fn, mask, truth = case(ddp, rank, world, args.terms, m)
        times = {k: [] for k in METHODS}
        last = {}
        # GradLoc has no adaptive threshold: it gets a quarter of auto's (in this rank's loss
        # units: auto reports the optimizer's, W times smaller), low enough for its trigger and
        # its pruning at T * sqrt(size) to let the placed culprits through
        probe = gradloc_track.locate(model, loss_fn, mask, method="auto", budget=args.budget)
        thresholds = {"auto": None, "gradloc": probe.threshold * world / 4}
        for rep in range(args.repeats):
            for method in (METHODS if rep % 2 == 0 else METHODS[::-1]):  # interleaved
                dist.barrier()
                t0 = time.perf_counter()
                res = gradloc_track.locate(model, loss_fn, mask, method=method, budget=args.budget,
                                           threshold=thresholds[method])
                elapsed = torch.tensor([time.perf_counter() - t0])
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's time
                times[method].append(float(elapsed))
                last[method] = res
        for method in METHODS:
            res = last[method]
            got = {(c.rank, c.batch, c.position) for c in res.tokens}
            rows.append((world, m, method, res.probes, statistics.median(times[method]),
                         len(got & truth) / len(truth), len(got - truth)))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--culprits", type=int, nargs="+", default=[1, 3])
    ap.add_argument("--terms", type=int, default=1024, help="loss terms per rank (a multiple of 256)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--budget", type=int, default=256)
    args = ap.parse_args()
    rows = []
    for world in args.worlds:
        rows += run_ranks(world, worker, args)
    print(f"\nlocate() under DDP on gloo, {args.terms} loss terms per rank, culprits on different ranks")
    print(f"{'world':>6}{'m':>4}{'method':>9}{'probes':>8}{'seconds':>9}{'recall':>8}{'false+':>8}{'probe ratio':>13}")
    by = {(w, m, meth): (p, s) for w, m, meth, p, s, _, _ in rows}
    for w, m, meth, probes, secs, rec, fp in rows:
        ratio = f"{by[(w, m, 'gradloc')][0] / probes:.1f}x" if meth == "auto" else ""
        print(f"{w:>6}{m:>4}{meth:>9}{probes:>8}{secs:>9.3f}{rec:>8.2f}{fp:>8}{ratio:>13}")
    print("probe ratio = GradLoc probes / auto probes (same batches, same process group)")


if __name__ == "__main__":
    main()
