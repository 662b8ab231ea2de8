"""Mean and variance of a device-side signal: exact over a warm-up buffer, then an EMA.

Shared by ZClip (the global norm, shape ``()``) and LayerClip (one norm per layer, shape ``(L,)``).
Values stay on the device and nothing here reads them on the host.

A value flagged not ``ok`` (a non-finite gradient, a zero norm, a layer without gradient) never
enters, element by element: each element counts its own usable values, warms up on its first
``warmup`` of them (population mean/variance of the buffer) and only then follows the EMA. So a
layer that has no gradient for the first thousand steps (an unused branch, an MoE expert) warms
up on its own first gradients, instead of on zeros, and a zero-gradient step (an all-masked
batch) neither delays anything nor drags a mean to 0.
"""
from __future__ import annotations

from typing import Any

import torch

from .checkpoint import check_state


class WarmupEma:
    def __init__(self, warmup: int, alpha: float, shape: tuple[int, ...], device: torch.device) -> None:
        self.warmup, self.alpha = warmup, alpha
        self.buffer = torch.zeros((warmup, *shape), device=device)  # (W, *shape)
        self.count = torch.zeros(shape, dtype=torch.int64, device=device)  # usable values seen, per element
        self.calls = 0  # host: add() calls; no element can be ready before ``warmup`` of them
        self.mean = torch.zeros(shape, device=device)
        self.var = torch.zeros(shape, device=device)

    @property
    def maybe_ready(self) -> bool:
        """Host-side: False while no element can have finished its warm-up (no device read)."""
        return self.calls >= self.warmup

    @property
    def ready(self) -> torch.Tensor:
        """Device bool, per element: warm-up done, ``mean``/``var`` are meaningful."""
        return self.count >= self.warmup

    @property
    def std(self) -> torch.Tensor:
        return self.var.sqrt()

    def add(self, x: torch.Tensor, ok: torch.Tensor) -> None:
        """Feed one value per element; elements where ``ok`` is False are left exactly as they were."""
        self.calls += 1
        warm = self.count < self.warmup
        write = ok & warm
        flat = self.buffer.view(self.warmup, -1)  # (W, K)
        pos = self.count.clamp(max=self.warmup - 1).reshape(1, -1)  # (1, K) next free slot
        slot = torch.where(write.reshape(1, -1), x.reshape(1, -1).to(flat.dtype), flat.gather(0, pos))
        flat.scatter_(0, pos, slot)
        self.count = self.count + write
        ema_ok = ok & ~warm
        mean = self.alpha * self.mean + (1 - self.alpha) * x
        var = self.alpha * self.var + (1 - self.alpha) * (x - mean).pow(2)
        mean, var = torch.where(ema_ok, mean, self.mean), torch.where(ema_ok, var, self.var)
        if self.maybe_ready:  # an element may complete its warm-up now: population statistics of its buffer
            done = write & (self.count == self.warmup)
            b_mean = self.buffer.mean(0)
            b_var = (self.buffer - b_mean).pow(2).mean(0)
            mean, var = torch.where(done, b_mean, mean), torch.where(done, b_var, var)
        self.mean, self.var = mean, var

    def state_dict(self) -> dict[str, Any]:
        return {"calls": self.calls, "count": self.count.clone(), "buffer": self.buffer.clone(),
                "mean": self.mean.clone(), "var": self.var.clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        dev = self.buffer.device
        self.buffer, self.mean, self.var = (state[k].to(dev).clone() for k in ("buffer", "mean", "var"))
        if "count" in state:
            self.calls, self.count = int(state["calls"]), state["count"].to(dev).clone()
        else:  # 0.2 checkpoints: one shared count ``n``
            n = int(state["n"])
            self.calls, self.count = n, torch.full_like(self.mean, min(n, self.warmup), dtype=torch.int64)


class WarmupEmaState:
    """``state_dict``/``load_state_dict`` of a clipper whose running state is one ``WarmupEma``
    (``self.stats``) plus the step count (ZClip, LayerClip). Listed before ``Clipper`` in the bases."""

    steps: int
    stats: WarmupEma
    saturation: Any

    @property
    def warming_up(self) -> bool:
        return not self.stats.maybe_ready

    def state_dict(self) -> dict[str, Any]:
        return {"kind": type(self).kind, "steps": self.steps, "stats": self.stats.state_dict(),
                "saturation": self.saturation.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_state(self, state)
        self.steps = int(state["steps"])
        self.stats.load_state_dict(state["stats"])
        self.saturation.load_state_dict(state.get("saturation"))
