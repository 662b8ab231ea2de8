"""``tests/dist/launch.fork_ranks`` with verl preloaded in the forkserver: each rank forks with verl's
engine already imported (about 10 s of imports paid once, not once per rank)."""
from __future__ import annotations

import time

from tests.dist.launch import _forked_main, free_port

PRELOAD = ["torch", "torch.distributed", "gradloc_track.localizer", "tests.dist.launch", "verl",
           "verl.workers.engine.fsdp.transformer_impl", "verl.workers.utils.losses", "gradloc_track.integrations.verl",
           "tests.integrations.verl.worker"]


def fork_ranks(target, world: int, args: tuple, timeout: float = 300.0) -> None:
    """Run ``target(rank, world, port, *args)`` on ``world`` ranks; raise if one fails or hangs past ``timeout``."""
    import multiprocessing as mp

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
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
