"""Result types of the localizer, shared by the monitor and the artifact writers."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch


@dataclass
class CulpritToken:
    """One loss term whose own gradient is above the threshold."""

    batch: int
    position: int
    grad_norm: float  # exact L2 norm of this term's gradient (from a single-term probe)
    layer_norms: dict[str, float] = field(default_factory=dict)  # layer -> exact norm
    score: float | None = None  # the ranking estimate (ghost map) that led to it, if any
    # <g_term, g_total> / ||g_total||^2: this term's additive share of the spike's squared norm
    share: float | None = None
    micro_batch: int | None = None  # which micro-batch of the step (None: the step had one)
    rank: int | None = None  # which process's batch (None: not a distributed localization)


@dataclass
class LocateResult:
    tokens: list[CulpritToken]  # culprits, largest grad_norm first
    probes: int  # forward+backward passes used
    method: str
    threshold: float  # per-term threshold actually used
    total_norm: float  # norm of the full-batch gradient (all terms)
    layer_names: list[str] = field(default_factory=list)
    # (B, T) per-term contribution estimate from the ghost pass (CPU float32), for highlighting
    ghost_map: torch.Tensor | None = None
    # (L, B, T) per-layer per-position ghost norms (CPU float32), rows follow layer_names
    layer_map: torch.Tensor | None = None
    budget_exhausted: bool = False
    wall_time_s: float = 0.0
    notes: list[str] = field(default_factory=list)
    # one entry per micro-batch when the step had several (K > 1): the norm of that micro-batch's
    # gradient and its (B_k, T_k) / (L, B_k, T_k) ghost maps (None where no ghost pass ran);
    # ``ghost_map``/``layer_map`` above are then None (shapes may differ across micro-batches)
    micro_batch_norms: list[float] = field(default_factory=list)
    ghost_maps: list[torch.Tensor | None] = field(default_factory=list)
    layer_maps: list[torch.Tensor | None] = field(default_factory=list)

    def for_micro_batch(self, k: int) -> "LocateResult":
        """This result seen as a one-micro-batch result for micro-batch ``k`` (its culprits and maps),
        so single-batch consumers (highlighting, heatmaps) can render one micro-batch at a time."""
        if not self.micro_batch_norms:
            return self
        return replace(self, tokens=[t for t in self.tokens if t.micro_batch == k],
                       ghost_map=self.ghost_maps[k], layer_map=self.layer_maps[k])

    def as_dict(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "probes": self.probes,
            "threshold": self.threshold,
            "total_norm": self.total_norm,
            "budget_exhausted": self.budget_exhausted,
            "tokens": [
                {"batch": t.batch, "position": t.position, "grad_norm": t.grad_norm,
                 "layer_norms": t.layer_norms, "score": t.score, "micro_batch": t.micro_batch, "rank": t.rank}
                for t in self.tokens
            ],
        }
