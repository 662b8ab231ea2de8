"""The step's losses for the spike detector, from what ``watch()`` already captures (issue 26).

- ``loss``: the loss the model returned for each micro-batch (HF's ``.loss``, nanoGPT's ``(logits,
  loss)``), detached, averaged over the step's micro-batches: free, no extra pass.
- the largest per-sample loss: each sample's mean loss over its loss terms (the row, also when
  ``position_ids`` pack documents; repeats of the input token capped: ``spikes/sample_loss.py``):
  one cross-entropy pass over the logits the training forward already made, row by row under
  ``no_grad`` and a block of positions at a time (``spikes/logit_blocks.py``), in the same pass as
  the junk signal's excess (``detector_losses``). Its cost grows with the vocabulary;
  ``spikes.sample_signal=false`` turns it off.

Everything stays on the device (no host sync): the monitor moves it with the step's other values.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.nn.functional as F

from ..spikes.junk import JunkSpan, junk_of, term_excess
from ..spikes.logit_blocks import per_position
from ..spikes.sample_loss import sample_losses

IGNORE = -100


def loss_in(out: Any) -> torch.Tensor | None:
    """The scalar loss a forward returned (``.loss``, or a 0-d tensor in a tuple), detached; else None."""
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, (tuple, list)):
        loss = next((o for o in out if isinstance(o, torch.Tensor) and o.dim() == 0), None)
    return loss.detach() if isinstance(loss, torch.Tensor) and loss.dim() == 0 else None


def document_index(position_ids: torch.Tensor | None, shape: torch.Size) -> torch.Tensor:
    """(B, T) index of the document each position belongs to within its row (0 without restarts)."""
    if position_ids is None:
        return torch.zeros(shape, dtype=torch.long)
    start = (position_ids == 0).long()
    return start.cumsum(1) - start[:, :1]


@torch.no_grad()
def detector_losses(logits: torch.Tensor, targets: torch.Tensor, input_ids: torch.Tensor | None = None,
                    document_ids: torch.Tensor | None = None, samples: bool = True,
                    junk_terms: int | None = None) -> tuple[torch.Tensor | None, JunkSpan | None]:
    """(the largest sample's mean loss, the junk statistics) of a micro-batch, each only when asked,
    from ONE blockwise pass over each row's logits (``logit_blocks``). The largest sample loss is
    ``spikes.sample_loss.sample_losses``' (the row is the unit, repeats of the input token capped),
    0-d on the logits' device, NaN when any is NaN; the junk statistics are ``spikes.junk``'s.
    ``logits`` (B, T, V) at the model's positions, ``targets`` (B, T) with ``IGNORE`` where a
    position has no term, ``input_ids`` (B, T) the ids at the same positions, ``document_ids`` (B, T)
    for packed rows."""
    tgt = targets.to(logits.device)
    inp = None if input_ids is None else input_ids.to(logits.device)

    def terms(z: torch.Tensor, t: torch.Tensor, i: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        loss = F.cross_entropy(z, t, reduction="none") if samples else t.new_zeros(t.shape, dtype=torch.float32)
        return loss, (term_excess(z, t, i) if junk_terms else loss)

    rows = [per_position(terms, logits[b], tgt[b].clamp(min=0), None if inp is None else inp[b])
            for b in range(tgt.shape[0])]
    valid = tgt != IGNORE
    smax = sample_losses(torch.stack([r[0] for r in rows]), valid, inp, tgt).max() if samples else None
    junk = junk_of(torch.stack([r[1] for r in rows]), valid, document_ids, junk_terms) if junk_terms else None
    return smax, junk


def unit_loss_max(logits: torch.Tensor, targets: torch.Tensor, input_ids: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """The largest sample's mean loss in a micro-batch (``detector_losses`` without the junk pass)."""
    return detector_losses(logits, targets, input_ids)[0]


def step_loss(batches: Sequence[Any]) -> torch.Tensor | None:
    """The step's loss for the detector: the mean of its micro-batches' own losses (0-d, device, no
    sync); None when a micro-batch's forward returned none."""
    losses = [getattr(b, "loss", None) for b in batches]
    if not losses or any(v is None for v in losses):
        return None
    return torch.stack([v.float().to(losses[0].device) for v in losses]).mean()


def step_junk(batches: Sequence[Any]) -> list[Any] | None:
    """Each micro-batch's junk-span statistics (``spikes/junk.py``; the monitor combines them), or None."""
    out = [b.junk for b in batches if getattr(b, "junk", None) is not None]
    return out or None


def step_sample_losses(batches: Sequence[Any]) -> list[torch.Tensor] | None:
    """Each micro-batch's largest per-unit loss (the monitor keeps the largest), or None."""
    out = [b.sample_max for b in batches if getattr(b, "sample_max", None) is not None]
    return out or None
