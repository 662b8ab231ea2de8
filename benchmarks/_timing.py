"""Interleaved timing: variants run round-robin so machine noise hits all of them alike."""
from __future__ import annotations

import statistics
import time
from typing import Callable


def interleaved(variants: dict[str, Callable[[int], None]], rounds: int, warmup: int = 3) -> dict[str, float]:
    """Median seconds per call of each variant; ``variants[name](i)`` runs one step."""
    for i in range(warmup):
        for fn in variants.values():
            fn(i)
    times: dict[str, list[float]] = {k: [] for k in variants}
    for r in range(rounds):
        order = list(variants.items())
        if r % 2:  # alternate order so no variant always runs right after another
            order.reverse()
        for name, fn in order:
            t0 = time.perf_counter()
            fn(warmup + r)
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def report(title: str, medians: dict[str, float], baseline: str) -> None:
    base = medians[baseline]
    print(f"\n{title}")
    print(f"{'variant':<44}{'median ms':>10}{'ratio':>9}")
    for name, t in medians.items():
        print(f"{name:<44}{t * 1e3:>10.1f}{t / base:>9.3f}")
