"""Realistic data outliers injected at a known step (the spike demo).

``short_garbage_doc``: one sample of the batch is replaced by a nearly empty, corrupted
document — a few bytes of mojibake followed by padding that carries no loss. Under per-sample
loss averaging (``train.loss_norm=sample``, the SFT default of many trainers) each of those few
loss tokens weighs ``T / span`` times more than a normal token, and the garbage targets have
near-zero probability: a classic real-world cause of a gradient spike, pinned on a handful of
tokens.
``corrupt_span``: a span of garbage bytes inside an otherwise normal sequence (token-mean loss:
usually *not* a spike — useful to see that the detector stays quiet).
"""
from __future__ import annotations

import torch

PAD_ID = 0  # byte 0 never occurs in the text corpus


def inject(kind: str, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor, sample: int, span: int,
           seed: int = 1234) -> list[int]:
    """Corrupt ``sample`` of the batch in place; returns the positions of the corrupted loss terms.

    x, y: (B, T) inputs and targets; mask: (B, T) float loss mask.
    """
    B, T = x.shape
    if not 0 <= sample < B:
        raise ValueError(f"train.inject.sample={sample} is outside the batch (batch_size={B})")
    if not 1 <= span < T:
        raise ValueError(f"train.inject.span={span} must be in [1, seq_len)")
    g = torch.Generator().manual_seed(seed)
    garbage = torch.randint(0xC0, 0x100, (span + 1,), generator=g)  # bytes never seen in ASCII text
    if kind == "short_garbage_doc":
        x[sample].fill_(PAD_ID)
        y[sample].fill_(PAD_ID)
        mask[sample].zero_()
        x[sample, : span] = garbage[:span]
        y[sample, : span] = garbage[1: span + 1]
        mask[sample, : span] = 1.0
        return list(range(span))
    if kind == "corrupt_span":
        start = T // 2
        x[sample, start: start + span] = garbage[:span]
        y[sample, start: start + span] = garbage[1: span + 1]
        return list(range(start, start + span))
    raise ValueError(f"train.inject.kind={kind!r} is unknown: use short_garbage_doc or corrupt_span")
