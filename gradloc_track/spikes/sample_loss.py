"""Each sample's mean loss, as the detector's sample signal reads it (``after_backward(sample_losses=)``).

Two rules, both from the spike zoo's false events (docs/benchmarks.md):

- **The unit is the sample (the row), also for packed rows.** A packed document's mean over a handful
  of terms is the noisiest unit there is: the largest of 32 such means (16-token documents) made 6 of
  the demo family's 8 false events on its clean twins. Garbage inside a document is the junk
  signal's (``spikes/junk.py``), which keeps to document boundaries.
- **A term whose target repeats its input token counts at most the batch's mean term loss.** A run of
  one repeated token (a reST rule of 63 ``=``, a run of spaces) is the cheapest thing a model learns
  and, early in training, one of its most costly: such rows made the other false events. The junk
  signal treats repeats alike.
"""
from __future__ import annotations

import torch


@torch.no_grad()
def sample_losses(token_losses: torch.Tensor, mask: torch.Tensor, input_ids: torch.Tensor | None = None,
                  targets: torch.Tensor | None = None) -> torch.Tensor:
    """(B,) each sample's mean loss over its loss terms (``-inf`` for a sample without terms; NaN stays
    NaN). ``token_losses`` (B, T) each position's loss (any value where ``mask`` is 0), ``mask`` (B, T)
    the loss terms (bool or 0/1), ``input_ids`` and ``targets`` (B, T) the ids at each position and the
    ids its logits predict (shifted): a term with ``targets == input_ids`` counts at most the batch's
    mean term loss (without them no term is capped)."""
    if token_losses.dim() != 2 or mask.shape != token_losses.shape:
        raise ValueError(f"sample_losses: token_losses and mask must both be (B, T) (one loss per position of each "
                         f"sample; mask 1 where a position is a loss term); got {tuple(token_losses.shape)} and "
                         f"{tuple(mask.shape)}")
    for name, ids in (("input_ids", input_ids), ("targets", targets)):
        if ids is not None and ids.shape != token_losses.shape:
            raise ValueError(f"sample_losses: {name} must be (B, T) like token_losses {tuple(token_losses.shape)}; "
                             f"got {tuple(ids.shape)}")
    valid = mask if mask.dtype == torch.bool else mask > 0
    repeat = None
    if input_ids is not None and targets is not None:
        dev = token_losses.device
        repeat = valid & (targets.to(dev) == input_ids.to(dev))
    return row_means(token_losses, valid, valid.sum(1), repeat)


def row_means(token_losses: torch.Tensor, valid: torch.Tensor, count: torch.Tensor,
              repeat: torch.Tensor | None, *, invalid: torch.Tensor | None = None,
              n_terms: torch.Tensor | None = None) -> torch.Tensor:
    """``sample_losses`` from parts the caller may already hold (``watch()``'s per-step pass shares them with
    the junk signal): ``valid`` (B, T) bool, ``count`` its row sums, ``repeat`` (B, T) bool the valid terms
    whose target repeats the input token (None: none capped); ``invalid`` ``~valid`` and ``n_terms`` the number
    of terms, at least 1 (each made here when not given)."""
    per = token_losses.detach() if token_losses.requires_grad else token_losses
    per = (per if per.dtype == torch.float32 else per.float()).masked_fill(~valid if invalid is None else invalid, 0.0)
    if repeat is not None:
        n_terms = count.sum().clamp(min=1) if n_terms is None else n_terms
        mean = per.sum() / n_terms  # NaN when any term is: it stays NaN below
        per = torch.where(repeat, torch.minimum(per, mean), per)
    return (per.sum(1) / count.clamp(min=1)).masked_fill_(count == 0, -torch.inf)
