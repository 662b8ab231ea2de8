"""A detected gradient spike."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SpikeEvent:
    step: int
    signal: str  # "global" or a layer name (as in grad_norm/<layer>)
    value: float  # the norm at this step
    baseline: float  # the running mean it was compared with
    z: float  # (value - baseline) / running std
    ratio: float  # value / baseline
