"""Run one benchmark function on ``world`` gloo ranks (spawned processes) and return rank 0's result.

``target(rank, world, args)`` runs inside the initialised process group (one torch thread per rank:
they share the machine's cores) and returns what rank 0 reports; the other ranks' returns are ignored.
"""
from __future__ import annotations

import os
import socket
import sys
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _rank(rank: int, world: int, port: str, target: Callable, args: Any, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    out = target(rank, world, args)
    if rank == 0:
        queue.put(out)
    dist.barrier()
    dist.destroy_process_group()


def run_ranks(world: int, target: Callable[[int, int, Any], Any], args: Any, timeout_s: float = 600) -> Any:
    """``target`` on ``world`` gloo ranks; rank 0's return. A rank that fails stops the benchmark."""
    ctx = mp.get_context("spawn")
    queue, port = ctx.SimpleQueue(), free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, target, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    out = queue.get()
    for p in procs:
        p.join(timeout_s)
        if p.exitcode != 0:
            sys.exit(f"a rank failed (exit code {p.exitcode})")
    return out
