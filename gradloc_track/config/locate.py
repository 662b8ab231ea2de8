"""Localizer config (group ``locate``): how a detected spike is traced to its loss terms."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from ._validate import check, check_types, one_of

METHODS = ("auto", "ghost", "bisect", "gradloc")


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class LocateConfig:
    enabled: bool = True
    method: str = "auto"  # auto | ghost | bisect | gradloc (GradLoc's own procedure; needs threshold)
    budget: int = 128  # probes (gradloc: token-stage probes, as GradLoc's bisect_budget_steps)
    threshold: Optional[float] = None  # per-term gradient norm; None = adaptive from the batch's own terms
    max_events: int = 20  # localize at most this many spikes per run
    top_layers: int = 3
    # later probes of a micro-batch replay its first forward's graph (a backward each, exact): ~a third of each
    # probe saved, for more peak memory: the kept activations plus a backward's temporaries (3-5 gradient sizes on
    # bench_locate's long-row model); off by default, the CPU demo turns it on
    reuse_forward: bool = False

    def __post_init__(self) -> None:
        # the numbers' own checks below say what a valid value means (probes, events, layers)
        check_types(self, "locate", skip=("budget", "threshold", "max_events", "top_layers"))
        one_of("locate.method", self.method, METHODS)
        check(_whole(self.budget) and self.budget >= 1, "locate.budget", self.budget,
              "use a positive whole number of probes (e.g. 128)")
        if self.threshold is not None:
            check(not isinstance(self.threshold, bool) and isinstance(self.threshold, (int, float))
                  and 0 < self.threshold < math.inf, "locate.threshold", self.threshold,
                  "use a positive per-term gradient norm, or null for an adaptive threshold")
        check(self.method != "gradloc" or self.threshold is not None, "locate.threshold", self.threshold,
              "locate.method=gradloc needs GradLoc's per-token threshold T in your loss's units "
              "(T_official * micro_batches / n_norm for a verl token-mean loss); or use locate.method=auto")
        check(_whole(self.max_events) and self.max_events >= 0, "locate.max_events", self.max_events,
              "use 0 (never localize) or a positive whole number of events per run")
        check(_whole(self.top_layers) and self.top_layers >= 1, "locate.top_layers", self.top_layers,
              "use a positive whole number of layers to list per culprit (e.g. 3)")
