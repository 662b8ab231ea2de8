"""Leave no trace: what localization touches is saved first and restored exactly afterwards."""
from __future__ import annotations

import torch

from .probe import restore_rng, save_rng


class Snapshot:
    """Gradients (bitwise, ``None`` kept ``None``), RNG state, train/eval modes, requires_grad."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.params = list(model.parameters())
        self.grads = [None if p.grad is None else p.grad.detach().clone() for p in self.params]
        self.requires_grad = [p.requires_grad for p in self.params]
        self.modes = {m: m.training for m in model.modules()}
        self.rng = save_rng()

    def restore(self) -> None:
        for p, g, rg in zip(self.params, self.grads, self.requires_grad):
            p.grad = g
            p.requires_grad_(rg)
        for m, training in self.modes.items():
            m.training = training
        restore_rng(self.rng)
