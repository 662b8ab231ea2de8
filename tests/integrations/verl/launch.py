"""``tests/dist/launch``'s ranks, FORKED from this process with verl already imported here.

``import verl`` costs 10-60 s on this machine (Ray, every engine it finds). A forkserver is a new
interpreter that imports it again; forking this process (which imported it for the in-process
tests anyway) pays it once for the whole run. Safe here: this process has started no thread and
no process group when it forks (``preload`` runs first), and each rank ends in ``os._exit``.
``Ranks`` starts a launch and returns at once, so the world sizes run side by side.
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


class Ranks:
    """``target(rank, world, port, *args)`` on ``world`` forked ranks, started now; ``wait`` raises
    if one fails or is still running ``timeout`` seconds after the start (a hang: killed)."""

    def __init__(self, target, world: int, args: tuple, timeout: float = 300.0) -> None:
        import multiprocessing as mp

        preload()
        ctx = mp.get_context("fork")
        port = free_port()
        self.deadline = time.monotonic() + timeout
        self.timeout = timeout
        self.procs = [ctx.Process(target=_forked_main, args=(target, r, world, port, args)) for r in range(world)]
        for p in self.procs:
            p.start()

    def wait(self) -> None:
        for p in self.procs:
            p.join(max(0.0, self.deadline - time.monotonic()))
        hung = [r for r, p in enumerate(self.procs) if p.is_alive()]
        self.kill()
        if hung:
            raise AssertionError(f"ranks {hung} did not finish within {self.timeout} s (deadlock?)")
        bad = {r: p.exitcode for r, p in enumerate(self.procs) if p.exitcode != 0}
        if bad:
            raise AssertionError(f"ranks failed with exit codes {bad} (their tracebacks are in the captured stderr)")

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()  # our own children, by handle
                p.join()

