"""The step's losses for the spike detector, from what ``watch()`` already captures (issue 26).

- ``loss``: the loss the model returned for each micro-batch (HF's ``.loss``, nanoGPT's ``(logits,
  loss)``), detached, averaged over the step's micro-batches: free, no extra pass.
- the largest per-sample loss: each sample's mean loss over its loss terms (the row, also when
  ``position_ids`` pack documents; repeats of the input token capped: ``spikes/sample_loss.py``),
  and the junk signal's excess over chance, both from ``spikes/term_stats.py`` (``detector_losses``):
  when the model's own loss is a cross-entropy over the logits it returned, from the log-probabilities
  that loss saved for its backward (a gather and one sum over the vocabulary: no exp, issue 38), else
  from one blockwise read of the logits. ``spikes.sample_signal=false`` / ``junk_signal=false`` turn
  them off.

Everything stays on the device (no host sync): the monitor moves it with the step's other values.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from ..spikes.junk import junk_stats, leaked_shares
from ..spikes.sample_loss import row_means
from ..spikes.term_stats import saved_log_probs, term_stats

IGNORE = -100


def loss_in(out: Any) -> torch.Tensor | None:
    """The scalar loss a forward returned (``.loss``, or a 0-d tensor in a tuple), detached; else None."""
    loss = _loss_tensor(out)
    return None if loss is None else loss.detach()


def _loss_tensor(out: Any) -> torch.Tensor | None:
    loss = getattr(out, "loss", None)
    if loss is None and isinstance(out, (tuple, list)):
        loss = next((o for o in out if isinstance(o, torch.Tensor) and o.dim() == 0), None)
    return loss if isinstance(loss, torch.Tensor) and loss.dim() == 0 else None


def document_index(position_ids: torch.Tensor | None, shape: torch.Size) -> torch.Tensor:
    """(B, T) index of the document each position belongs to within its row (0 without restarts)."""
    if position_ids is None:
        return torch.zeros(shape, dtype=torch.long)
    start = (position_ids == 0).long()
    return start.cumsum(1) - start[:, :1]


@torch.no_grad()
def detector_losses(logits: torch.Tensor, targets: torch.Tensor, input_ids: torch.Tensor | None = None,
                    document_ids: torch.Tensor | None = None, samples: bool = True,
                    junk_terms: int | None = None, output: Any = None, with_rows: bool = False) -> tuple:
    """(the largest sample's mean loss, the junk statistics) of a micro-batch, each only when asked.
    The largest sample loss is ``spikes.sample_loss.sample_losses``' (the row is the unit, repeats of
    the input token capped), 0-d on the logits' device, NaN when any is NaN (-inf: no sample has a
    term); the junk statistics are ``spikes.junk``'s. ``logits`` (B, T, V) at the model's positions,
    ``targets`` (B, T) with ``IGNORE`` where a position has no term, ``input_ids`` (B, T) the ids at
    the same positions, ``document_ids`` (B, T) for packed rows, ``output`` the forward's output: when
    its loss is a cross-entropy over ``logits``, the terms come from what that loss saved (module doc).
    ``with_rows``: a third value, each row's mean loss (B,), whose maximum the first is (None without it)."""
    if not (samples or junk_terms):
        return (None, None, None) if with_rows else (None, None)
    B, T = targets.shape
    saved = saved_log_probs(_loss_tensor(output), logits) if output is not None else None
    if saved is not None and saved.target.numel() in (B * T, B * (T - 1)):
        Tp = saved.target.numel() // B  # HF's loss keeps every position; a shifted one T - 1
        tgt = saved.target.view(B, Tp)
        valid = tgt != saved.ignore_index
        stats = term_stats(saved.log_probs, tgt.clamp(min=0), log_probs=True, loss=samples, excess=bool(junk_terms))
    else:
        Tp, tgt = T, targets.to(logits.device)
        valid = tgt != IGNORE
        stats = term_stats(logits, tgt.clamp(min=0), log_probs=False, loss=samples, excess=bool(junk_terms))
    inp = None if input_ids is None else input_ids[:, :Tp]
    if inp is not None and inp.device != tgt.device:
        inp = inp.to(tgt.device)
    # the parts both signals read, made once: the positions without a term, each row's term count and the
    # batch's (at least 1), the terms whose target repeats the input
    invalid = ~valid
    count = valid.sum(1)  # (B,)
    n_terms = count.sum().clamp(min=1)
    repeat = None if inp is None else valid & (tgt == inp)  # (B, T)
    means = row_means(stats.loss.view(B, Tp), valid, count, repeat, invalid=invalid,
                      n_terms=n_terms) if samples else None
    smax = means.max() if samples else None
    junk = None
    if junk_terms:
        excess = stats.excess.view(B, Tp)
        if repeat is not None:  # cap_repeats (only valid terms are ever read)
            excess = torch.where(repeat, excess.clamp(max=0.0), excess)
        rows = None if inp is None else leaked_shares(repeat, inp, valid)
        docs = None if document_ids is None else document_ids[:, :Tp]
        junk = junk_stats(excess, valid, docs, junk_terms, rows, n_terms, invalid=invalid, clamped=True)
    return (smax, junk, means) if with_rows else (smax, junk)


def unit_loss_max(logits: torch.Tensor, targets: torch.Tensor, input_ids: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """The largest sample's mean loss in a micro-batch (``detector_losses`` without the junk pass)."""
    return detector_losses(logits, targets, input_ids)[0]


def step_loss(batches: Sequence[Any]) -> torch.Tensor | None:
    """The step's loss for the detector: the mean of its micro-batches' own losses, or their sum when each is
    over the whole step's count (HF's ``num_items_in_batch``) (0-d, device, no sync); None when a micro-batch's
    forward returned none. A micro-batch without a loss term (every label -100: its largest sample loss is
    -inf) is left out: its mean over no terms is NaN (HF's), which read as "the step's loss is NaN, skipped"
    while the step was applied (held-out tester round 8)."""
    losses = [getattr(b, "loss", None) for b in batches]
    if not losses or any(v is None for v in losses):
        return None
    dev = losses[0].device
    # HF Trainer's micro-batch losses are each sum / num_items_in_batch, one count for the whole step: the
    # step's loss is their sum (their mean read 1/K of it under K-step accumulation, tester round 12)
    summed = all(getattr(b, "num_items", None) is not None for b in batches)
    if all(getattr(b, "sample_max", None) is None for b in batches):
        stacked = torch.stack([v.float().to(dev) for v in losses])
        return stacked.sum() if summed else stacked.mean()
    vals, have = [], []
    for b, v in zip(batches, losses):
        m = getattr(b, "sample_max", None)
        h = torch.ones((), dtype=torch.bool, device=dev) if m is None else m.to(dev) != -math.inf  # NaN: has terms
        vals.append(torch.where(h, v.float().to(dev), 0.0))
        have.append(h)
    total = torch.stack(vals).sum()
    return total if summed else total / torch.stack(have).sum().clamp(min=1)


def step_junk(batches: Sequence[Any]) -> list[Any] | None:
    """Each micro-batch's junk-span statistics (``spikes/junk.py``; the monitor combines them), or None."""
    out = [b.junk for b in batches if getattr(b, "junk", None) is not None]
    return out or None


def step_sample_losses(batches: Sequence[Any]) -> list[torch.Tensor] | None:
    """Each micro-batch's largest per-unit loss (the monitor keeps the largest), or None."""
    out = [b.sample_max for b in batches if getattr(b, "sample_max", None) is not None]
    return out or None
