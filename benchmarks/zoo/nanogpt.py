"""A nanoGPT-style model for the held-out zoo's own loop: ``model(idx, targets) -> (logits, loss)``.

The library's ``TinyGPT`` (pre-LN GPT, nanoGPT's parameter names) with nanoGPT's forward: targets
already shifted, ``-1`` = no loss, the loss a mean over the terms. ``watch()`` reads such a call by
argument name (``idx``, ``targets``) and rebuilds the per-term loss from it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from gradloc_track.demo.model import TinyGPT


class NanoGPT(TinyGPT):
    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):  # type: ignore[override]
        logits = super().forward(idx)  # (B, T, V)
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-1)
        return logits, loss
