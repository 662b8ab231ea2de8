"""torch's thread count for the demo apps and examples: a default that holds on a busy machine.

torch uses one intra-op thread per core. The demo's models are small (0.9-6 M parameters): a
second thread buys little on an idle machine and costs a lot on a busy one, where threads wait
for each other (the spike demo took 383 s wall on 2 shared cores with torch's default, 119-160 s
with one thread). ``set_threads(None)`` takes half the cores this process may use, at most 4.
"""
from __future__ import annotations

import os

MAX_DEFAULT = 4


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, e.g. a container's share), else all."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # macOS, Windows
        return os.cpu_count() or 1


def default_threads(cores: int | None = None) -> int:
    """Half the usable cores, 1 to ``MAX_DEFAULT``."""
    return max(1, min(MAX_DEFAULT, (cores or usable_cores()) // 2))


def set_threads(n: int | None) -> int:
    """``torch.set_num_threads``: ``n`` (``train.num_threads``, ``--threads``), ``None`` for the
    default above, 0 for torch's own (every core). Returns the count in force."""
    import torch

    if n is None:
        n = default_threads()
    if n > 0:
        torch.set_num_threads(n)
    return torch.get_num_threads()
