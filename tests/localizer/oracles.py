"""Independent references for the localizer tests: plain backward passes, one per unit."""
from __future__ import annotations

import math
from typing import Callable, Iterable

import torch

from gradloc_track.demo.model import TinyGPT


def tiny_gpt(vocab: int, seq: int, dropout: float = 0.0, seed: int = 0) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT(vocab_size=vocab, n_layer=2, n_head=2, d_model=32, max_seq_len=seq, dropout=dropout)


def grads_of(model: torch.nn.Module, loss: torch.Tensor) -> list[torch.Tensor]:
    """The gradient of ``loss``, one dense tensor per trainable parameter (zeros where none)."""
    params = [p for p in model.parameters() if p.requires_grad]
    gs = torch.autograd.grad(loss, params, allow_unused=True)
    return [torch.zeros_like(p) if g is None else g.detach() for p, g in zip(params, gs)]


def norm(g: list[torch.Tensor]) -> float:
    return math.sqrt(sum(float(x.double().pow(2).sum()) for x in g))


def dot(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return sum(float((x.double() * y.double()).sum()) for x, y in zip(a, b))


def unit_grads(model, loss_fn: Callable[[torch.Tensor], torch.Tensor], masks: Iterable[torch.Tensor],
               rng: torch.Tensor | None = None) -> list[list[torch.Tensor]]:
    """One backward per mask (the RNG reset to ``rng`` before each, so dropout masks agree)."""
    out = []
    for m in masks:
        if rng is not None:
            torch.set_rng_state(rng)
        out.append(grads_of(model, loss_fn(m)))
    return out


def term_mask(shape: tuple[int, int], cells: Iterable[tuple[int, int]]) -> torch.Tensor:
    m = torch.zeros(shape)
    for b, t in cells:
        m[b, t] = 1.0
    return m
