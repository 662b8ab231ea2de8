"""Start one process per rank on a fresh gloo rendezvous; a hang fails within ``timeout``."""
from __future__ import annotations

import os
import socket
import sys


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _forked_main(target, rank: int, world: int, port: str, args: tuple) -> None:
    code = 1
    try:
        target(rank, world, port, *args)
        code = 0
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # skip interpreter teardown (gloo static destructors can std::terminate)


def fork_ranks(target, world: int, args: tuple, timeout: float = 240.0) -> None:
    """Run ``target(rank, world, port, *args)`` (a module-level function) in ``world`` processes
    forked from one forkserver that imported torch once (no per-rank interpreter start-up, and no
    fork of this possibly multi-threaded test process); raise if any fails or hangs past ``timeout``."""
    import multiprocessing as mp
    import time

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "gradloc_track.localizer", "tests.dist.launch"])
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
        raise AssertionError(f"ranks {hung} did not finish within {timeout} s (deadlock?); exit codes "
                             f"{[p.exitcode for p in procs]}")
    bad = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode != 0}
    if bad:
        raise AssertionError(f"ranks failed with exit codes {bad} (their tracebacks are in the captured stderr)")
