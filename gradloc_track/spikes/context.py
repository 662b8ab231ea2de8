"""What the monitor needs to localize a spike in the current batch."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch


@dataclass
class SpikeContext:
    """The current batch, as the localizer and the artifact writer see it.

    ``loss_fn(mask) -> scalar``: the training loss restricted to the loss terms selected by
    ``mask`` (same shape as ``token_mask``, 1.0 = keep) with a FIXED normalizer, so the
    gradient of a subset is the sum of its terms' gradients.
    """

    loss_fn: Callable[[torch.Tensor], torch.Tensor]
    token_mask: torch.Tensor  # (B, T) 1.0 where a loss term exists
    input_ids: torch.Tensor | None = None  # (B, T) token ids aligned with token_mask
    tokenizer: Any = None  # anything with decode(list[int]) -> str (HF tokenizers work)
    # per-token extra columns for the attribution table, each (B, T): advantage, logprob, ...
    extra_columns: Mapping[str, torch.Tensor] = field(default_factory=dict)
    # per-sample extra columns, each (B,): reward, ...
    sample_columns: Mapping[str, torch.Tensor] = field(default_factory=dict)
    # torch.get_rng_state() from before the training forward: probes replay its dropout masks
    rng_state: Any = None
