"""A small LM (optionally with BatchNorm or a sparse embedding), random batches with weighted culprit
terms, and an additive sum loss."""
from __future__ import annotations

import torch
import torch.nn.functional as F

V, B, T = 64, 4, 24


class LM(torch.nn.Module):
    """Embedding -> Linear -> head, optionally with a BatchNorm or a sparse embedding."""

    def __init__(self, batchnorm: bool = False, sparse: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(V, 64, sparse=sparse)
        self.mid = torch.nn.Linear(64, 64)
        self.bn = torch.nn.BatchNorm1d(64) if batchnorm else None
        self.head = torch.nn.Linear(64, V)

    def forward(self, x):
        h = torch.tanh(self.mid(torch.tanh(self.emb(x))))  # (B, T, C)
        if self.bn is not None:
            h = self.bn(h.transpose(1, 2)).transpose(1, 2)
        return self.head(h)


def data(n_culprits: int = 1, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, V, (B, T), generator=g)
    y = torch.randint(0, V, (B, T), generator=g)
    w = torch.ones(B, T)
    flat = torch.randperm(B * T, generator=g)[:n_culprits]
    w.view(-1)[flat] = 60.0
    return x, y, w, {(int(i) // T, int(i) % T) for i in flat}


def sum_loss(model, x, y, w):
    def loss_fn(mask):
        per = F.cross_entropy(model(x).reshape(-1, V), y.reshape(-1), reduction="none").view(B, T)
        return (per * w * mask).sum() / (B * T)  # fixed normalizer: additive over the mask
    return loss_fn
