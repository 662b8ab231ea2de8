"""GradMonitor config (group ``monitor``)."""
from __future__ import annotations

from dataclasses import dataclass, field

from ._validate import check, one_of
from ..grouping import GROUP_MODES


@dataclass
class MonitorConfig:
    log_every: int = 1  # log on steps where step % log_every == 0
    group_by: str = "block"  # block | module | tensor
    # optional explicit grouping: layer name -> regex on parameter names (first match wins)
    groups: dict[str, str] = field(default_factory=dict)
    per_tensor: bool = False  # also log grad_norm/tensor/<param name>
    weight_norms: bool = True  # weight_norm/* and grad_weight_ratio/*

    def __post_init__(self) -> None:
        check(isinstance(self.log_every, int) and self.log_every >= 1, "monitor.log_every",
              self.log_every, "use a positive integer (1 = log every step)")
        one_of("monitor.group_by", self.group_by, GROUP_MODES)
