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
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

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


def worker(rank: int, world: int, port: str, args, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
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
    if rank == 0:
        queue.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--culprits", type=int, nargs="+", default=[1, 3])
    ap.add_argument("--terms", type=int, default=1024, help="loss terms per rank (a multiple of 256)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--budget", type=int, default=256)
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    rows = []
    for world in args.worlds:
        queue = ctx.SimpleQueue()
        port = free_port()
        procs = [ctx.Process(target=worker, args=(r, world, port, args, queue)) for r in range(world)]
        for p in procs:
            p.start()
        rows += queue.get()
        for p in procs:
            p.join(600)
            if p.exitcode != 0:
                sys.exit(f"a rank failed (exit code {p.exitcode})")
    print(f"\nlocate() under DDP on gloo, {args.terms} loss terms per rank, culprits on different ranks")
    print(f"{'world':>6}{'m':>4}{'method':>9}{'probes':>8}{'seconds':>9}{'recall':>8}{'false+':>8}{'probe ratio':>13}")
    by = {(w, m, meth): (p, s) for w, m, meth, p, s, _, _ in rows}
    for w, m, meth, probes, secs, rec, fp in rows:
        ratio = f"{by[(w, m, 'gradloc')][0] / probes:.1f}x" if meth == "auto" else ""
        print(f"{w:>6}{m:>4}{meth:>9}{probes:>8}{secs:>9.3f}{rec:>8.2f}{fp:>8}{ratio:>13}")
    print("probe ratio = GradLoc probes / auto probes (same batches, same process group)")


if __name__ == "__main__":
    main()
