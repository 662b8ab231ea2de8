"""AdaGC: adaptive per-tensor gradient clipping (Wang et al., arXiv 2502.11034).

State: one scalar ``gamma_i`` per parameter tensor (an EMA of its clipped gradient norm).
- Warm-up (the first ``warmup_steps`` calls): ordinary global clipping at ``lambda_abs``;
  ``gamma_i`` = running minimum of the tensor's *post-clip* norm (as the official patch does).
- Afterwards: ``h_i = min(1, lambda_rel * gamma_i / (||g_i|| + eps))``, ``g_i <- h_i * g_i``,
  ``gamma_i <- beta * gamma_i + (1 - beta) * min(||g_i||, lambda_rel * gamma_i)``.
Defaults are those of the official PyTorch patch. Non-finite tensors never update ``gamma``.
"""
from __future__ import annotations

from typing import Any

import torch

from ..config._validate import check
from .base import Clipper, in_unit_interval, positive


class AdaGC(Clipper):
    kind = "adagc"

    def __init__(self, model: torch.nn.Module, lambda_rel: float = 1.04, beta: float = 0.99,
                 warmup_steps: int = 100, lambda_abs: float = 1.0, eps: float = 1e-6,
                 on_nonfinite: str = "skip", process_group: Any = None) -> None:
        positive("lambda_rel", lambda_rel, "1.04")
        positive("lambda_abs", lambda_abs, "1.0")
        in_unit_interval("beta", beta)
        check(warmup_steps >= 1, "warmup_steps", warmup_steps,
              "use 1 or more: warm-up steps initialise the per-tensor thresholds")
        check(eps >= 0, "eps", eps, "use a small non-negative number (e.g. 1e-6)")
        super().__init__(model, on_nonfinite, process_group)
        self.lambda_rel, self.beta, self.warmup_steps = lambda_rel, beta, warmup_steps
        self.lambda_abs, self.eps = lambda_abs, eps
        device = self.params[0].device
        self.gamma = torch.full((len(self.params),), float("inf"), device=device)  # (n,)

    @property
    def in_warmup(self) -> bool:
        return self.steps < self.warmup_steps

    def _coefs(self, norms, finite):
        if self.in_warmup:
            total = norms.pow(2).sum().sqrt()
            coef = (self.lambda_abs / (total + self.eps)).clamp(max=1.0)
            return torch.full_like(norms, self.lambda_abs), coef.expand_as(norms).clone()
        thr = self.lambda_rel * self.gamma  # (n,)
        return thr, (thr / (norms + self.eps)).clamp(max=1.0)

    def _update(self, norms, thresholds, coefs, finite_t, all_finite) -> None:
        if self.in_warmup:
            new = torch.minimum(self.gamma, norms * coefs)  # running min of post-clip norms
        else:
            thr = self.lambda_rel * self.gamma
            new = self.beta * self.gamma + (1 - self.beta) * torch.minimum(norms, thr)
        self.gamma = torch.where(finite_t, new, self.gamma)

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "gamma": self.gamma.detach().clone(), "names": list(self.names)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("names", self.names) != self.names:
            raise ValueError("AdaGC.load_state_dict: the checkpoint's parameter names differ from the model's")
        self.steps = int(state["steps"])
        self.gamma = state["gamma"].to(self.gamma.device).clone()
