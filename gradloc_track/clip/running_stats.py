"""Mean and variance of a device-side signal: exact over a warm-up buffer, then an EMA.

Shared by ZClip (the global norm, shape ``()``) and LayerClip (one norm per layer, shape ``(L,)``).
Values stay on the device; the warm-up count is a python int. A step flagged not ``ok`` (a
non-finite gradient) never enters: during warm-up the previous value is repeated, afterwards
the EMA is left as it was.
"""
from __future__ import annotations

from typing import Any

import torch


class WarmupEma:
    def __init__(self, warmup: int, alpha: float, shape: tuple[int, ...], device: torch.device) -> None:
        self.warmup, self.alpha = warmup, alpha
        self.buffer = torch.zeros((warmup, *shape), device=device)
        self.n = 0
        self.mean = torch.zeros(shape, device=device)
        self.var = torch.zeros(shape, device=device)

    @property
    def ready(self) -> bool:
        return self.n >= self.warmup

    @property
    def std(self) -> torch.Tensor:
        return self.var.sqrt()

    def add(self, x: torch.Tensor, ok: torch.Tensor) -> None:
        if not self.ready:
            prev = self.buffer[max(0, self.n - 1)]
            self.buffer[self.n] = torch.where(ok, x, prev)
            self.n += 1
            if self.ready:  # population statistics of the warm-up values
                self.mean = self.buffer.mean(0)
                self.var = (self.buffer - self.mean).pow(2).mean(0)
            return
        mean = self.alpha * self.mean + (1 - self.alpha) * x
        var = self.alpha * self.var + (1 - self.alpha) * (x - mean).pow(2)
        self.mean = torch.where(ok, mean, self.mean)
        self.var = torch.where(ok, var, self.var)

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n, "buffer": self.buffer.clone(), "mean": self.mean.clone(), "var": self.var.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.n = int(state["n"])
        dev = self.buffer.device
        self.buffer, self.mean, self.var = (state[k].to(dev).clone() for k in ("buffer", "mean", "var"))


class WarmupEmaState:
    """``state_dict``/``load_state_dict`` of a clipper whose running state is one ``WarmupEma``
    (``self.stats``) plus the step count (ZClip, LayerClip). Listed before ``Clipper`` in the bases."""

    steps: int
    stats: WarmupEma

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "stats": self.stats.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = int(state["steps"])
        self.stats.load_state_dict(state["stats"])
