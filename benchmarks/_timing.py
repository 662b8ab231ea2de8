"""Interleaved timing: variants run round-robin so machine noise hits all of them alike."""
from __future__ import annotations

import statistics
import time
from typing import Callable


def interleaved(variants: dict[str, Callable[[int], None]], rounds: int, warmup: int = 3,
                clock: Callable[[], float] = time.perf_counter) -> dict[str, float]:
    """Median seconds per call of each variant; ``variants[name](i)`` runs one step. ``clock``: wall time, or
    ``time.thread_time`` for the calling thread's CPU (what a busy machine's other work does not add to)."""
    for i in range(warmup):
        for fn in variants.values():
            fn(i)
    times: dict[str, list[float]] = {k: [] for k in variants}
    for r in range(rounds):
        order = list(variants.items())
        if r % 2:  # alternate order so no variant always runs right after another
            order.reverse()
        for name, fn in order:
            t0 = clock()
            fn(warmup + r)
            times[name].append(clock() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def report(title: str, medians: dict[str, float], baseline: str) -> None:
    base = medians[baseline]
    print(f"\n{title}")
    print(f"{'variant':<44}{'median ms':>10}{'ratio':>9}")
    for name, t in medians.items():
        print(f"{name:<44}{t * 1e3:>10.1f}{t / base:>9.3f}")
