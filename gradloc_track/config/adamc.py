"""AdamC's corrected weight decay, for programmatic use (not a Hydra group)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ._validate import check_types, positive


@dataclass
class AdamCConfig:
    """Corrected weight decay (AdamC): lambda_t = lambda * lr_t / lr_max.

    ``AdamCWeightDecay.from_config(optimizer, AdamCConfig(enabled=True, lr_max=3e-4), scheduler=sched)``
    builds it; ``enabled`` is the caller's switch. The example app reads ``optim.adamc`` and
    ``optim.adamc_lr_max`` instead.
    """

    enabled: bool = False
    lr_max: Optional[float] = None  # the schedule's PEAK lr; None = read it from the scheduler

    def __post_init__(self) -> None:
        check_types(self, "adamc")
        if self.lr_max is not None:
            positive("adamc.lr_max", self.lr_max, "3e-4, the schedule's peak lr")
