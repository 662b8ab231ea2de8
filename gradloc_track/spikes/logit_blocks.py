"""Per-position values from one row of logits, a block of positions at a time: at most ``CHUNK``
logits in fp32 at once. A 4096 x 152k row of bf16 logits is a 2.5 GB fp32 copy made whole (5 GB with
a log-softmax); the detector's losses and junk statistics read every armed step's logits this way."""
from __future__ import annotations

from typing import Callable

import torch

CHUNK = 1 << 24  # logits turned into fp32 at a time


def per_position(fn: Callable[..., tuple[torch.Tensor, ...]], logits: torch.Tensor,
                 *columns: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
    """``fn(block (t, V) fp32, *columns' rows for the block)`` over ``logits`` (T, V) in blocks of
    positions; each of its outputs, (t,) per block, joined to (T,). ``None`` columns stay None."""
    step = max(1, CHUNK // max(1, logits.shape[-1]))
    outs = [fn(logits[t:t + step].float(), *(None if c is None else c[t:t + step] for c in columns))
            for t in range(0, logits.shape[0], step)]
    return outs[0] if len(outs) == 1 else tuple(torch.cat(parts) for parts in zip(*outs))
