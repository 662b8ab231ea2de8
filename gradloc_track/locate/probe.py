"""Exact probes: one forward+backward of the loss restricted to a subset of loss terms.

Every probe starts from the same state: gradients cleared and the RNG reset to the state saved
when localization began, so dropout masks agree across probes and subset gradients add up.
"""
from __future__ import annotations

import math
from typing import Callable, Sequence

import torch

from ..grouping import LayerGrouping

Grads = list[torch.Tensor]  # one tensor per trainable parameter (zeros where no gradient)


class BudgetExhausted(Exception):
    pass


class Prober:
    def __init__(self, params: Sequence[torch.nn.Parameter], loss_fn: Callable[[torch.Tensor], torch.Tensor],
                 token_mask: torch.Tensor, rng_state: dict, budget: int, grouping: LayerGrouping) -> None:
        self.params = list(params)
        self.loss_fn = loss_fn
        self.token_mask = token_mask
        self.rng_state = rng_state
        self.budget = budget
        self.grouping = grouping
        self.count = 0

    def mask_of(self, terms: Sequence[tuple[int, int]]) -> torch.Tensor:
        m = torch.zeros_like(self.token_mask)
        if terms:
            idx = torch.as_tensor(terms, device=m.device)  # (k, 2)
            m[idx[:, 0], idx[:, 1]] = self.token_mask[idx[:, 0], idx[:, 1]]
        return m

    def probe(self, mask: torch.Tensor) -> Grads:
        """Gradient of ``loss_fn(mask)``; counts against the budget."""
        if self.count >= self.budget:
            raise BudgetExhausted
        self.count += 1
        for p in self.params:
            p.grad = None
        restore_rng(self.rng_state)
        loss = self.loss_fn(mask)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise TypeError("loss_fn(mask) must return a scalar tensor")
        if not loss.requires_grad:
            raise ValueError("loss_fn(mask) returned a loss that does not require grad: it must be computed "
                             "from the model's forward pass inside loss_fn")
        loss.backward()
        return [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p) for p in self.params]

    def probe_terms(self, terms: Sequence[tuple[int, int]]) -> Grads:
        return self.probe(self.mask_of(terms))

    # -- vector helpers ----------------------------------------------------------------
    @staticmethod
    def sq_per_tensor(g: Grads) -> torch.Tensor:
        return torch.stack(torch._foreach_norm(g, 2.0)).float().pow(2)

    def norm(self, g: Grads) -> float:
        return math.sqrt(float(self.sq_per_tensor(g).sum()))

    def layer_norms(self, g: Grads) -> dict[str, float]:
        vals = self.grouping.sum_by_layer(self.sq_per_tensor(g)).sqrt().tolist()
        return dict(zip(self.grouping.layers, vals))

    @staticmethod
    def dot(a: Grads, b: Grads) -> float:
        return float(sum((x.double() * y.double()).sum() for x, y in zip(a, b)))

    @staticmethod
    def sub(a: Grads, b: Grads) -> Grads:
        return torch._foreach_sub(a, b)


def save_rng() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])
