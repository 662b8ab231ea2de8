"""``tests/dist/launch``'s ranks, FORKED from this process with verl already imported here.

``import verl`` costs 10-60 s on this machine (Ray, every engine it finds). A forkserver is a new
interpreter that imports it again; forking this process (which imported it for the in-process
tests anyway) pays it once for the whole run. Safe here: this process has started no thread and
no process group when it forks (``preload`` runs first), and each rank ends in ``os._exit``.
"""
from __future__ import annotations

import importlib
import time

from tests.dist.launch import _forked_main, free_port

PRELOAD = ["torch", "torch.distributed", "verl", "verl.workers.engine.fsdp.transformer_impl",
           "verl.workers.utils.losses", "verl.utils.tracking", "verl.trainer.ppo.core_algos", "mlflow",
           "gradloc_track.localizer", "gradloc_track.integrations.verl.session", "tests.integrations.verl.worker"]


def preload() -> None:
    for name in PRELOAD:
        importlib.import_module(name)


def fork_ranks(target, world: int, args: tuple, timeout: float = 300.0) -> None:
    """Run ``target(rank, world, port, *args)`` on ``world`` forked ranks; raise if one fails or
    hangs past ``timeout``."""
    import multiprocessing as mp

    preload()
    ctx = mp.get_context("fork")
    port = free_port()
    procs = [ctx.Process(target=_forked_main, args=(target, r, world, port, args)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in hung:
        procs[r].kill()  # our own children, by handle
        procs[r].join()
    if hung:
        raise AssertionError(f"ranks {hung} did not finish within {timeout} s (deadlock?)")
    bad = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode != 0}
    if bad:
        raise AssertionError(f"ranks failed with exit codes {bad} (their tracebacks are in the captured stderr)")
