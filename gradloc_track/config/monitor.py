"""GradMonitor config (group ``monitor``)."""
from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Optional

from ._validate import check, check_types, one_of
from ..grouping import GROUP_MODES

RESERVED_LAYER_NAMES = frozenset({"global", "nonfinite"})  # grad_norm/global, grad_norm/nonfinite


@dataclass
class MonitorConfig:
    log_every: int = 1  # log on steps where step % log_every == 0
    group_by: str = "block"  # block | module | tensor
    # optional explicit grouping: layer name -> regex on parameter names (first match wins);
    # parameters no regex matches fall back to ``group_by``
    groups: dict[str, str] = field(default_factory=dict)
    per_tensor: bool = False  # also log grad_norm/tensor/<param name>
    weight_norms: bool = True  # weight_norm/* and grad_weight_ratio/*
    # adamc/steady_state_ratio: None = only when AdamCWeightDecay drives the optimizer
    adamc_ratio: Optional[bool] = None

    def __post_init__(self) -> None:
        check_types(self, "monitor", skip=("groups",))
        check(self.adamc_ratio is None or isinstance(self.adamc_ratio, bool), "monitor.adamc_ratio",
              self.adamc_ratio, "use true, false or null (null = only with AdamC's weight decay)")
        check(isinstance(self.groups, Mapping), "monitor.groups", self.groups,
              "use a mapping {layer_name: regex on parameter names}, e.g. {attention: '\\.attn\\.'}")
        check(self.log_every >= 1, "monitor.log_every", self.log_every, "use a positive integer (1 = log every step)")
        one_of("monitor.group_by", self.group_by, GROUP_MODES)
        for layer, pattern in self.groups.items():
            check(isinstance(layer, str) and layer != "" and "/" not in layer, "monitor.groups", layer,
                  "layer names must be non-empty strings without '/' (they become metric keys)")
            check(layer not in RESERVED_LAYER_NAMES, "monitor.groups", layer,
                  f"{sorted(RESERVED_LAYER_NAMES)} are taken by grad_norm/<name> keys; pick another name")
            check(isinstance(pattern, str), f"monitor.groups.{layer}", pattern, "use a regex string")
            try:
                re.compile(pattern)
            except re.error as exc:
                check(False, f"monitor.groups.{layer}", pattern, f"fix the regex ({exc})")
