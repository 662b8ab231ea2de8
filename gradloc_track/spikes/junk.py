"""The junk-span signal: a run of loss terms the model rates no better than random tokens.

A garbled span (random bytes, ids from the wrong vocabulary, a corrupted shard) hides inside a clean
sample: its sixteen terms move the sample's mean loss a little, the gradient norms not at all. What
sets it apart is not how high its loss is (tables, rules and unseen scripts are as surprising) but
that the model rates its tokens below *chance*: each term's loss exceeds ``U = -mean_v log p(v)``, the
loss a uniformly drawn vocabulary token would take at that position. Clean text, however odd, is
rated above chance once the model has learned anything; only a repeated token (``~~~~``, ``----``)
is rated below it by a young model that has not learned to copy, so a term whose target repeats its
input token counts at most 0.

``junk_span`` returns, per micro-batch, the largest mean of that excess over ``terms`` consecutive
loss terms of one document (nats a term; > 0: below chance), and the mean excess of all its terms
(how far above chance the model rates the batch: near 0 at initialisation, where the signal cannot
mean anything). The detector fires on the first above ``spikes.junk_margin`` while the second is
below ``LEARNED`` (``SpikeDetector``). Measured on the spike zoo (docs/benchmarks.md).
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch

from .term_stats import term_stats

IGNORE = -100
LEARNED = -1.0  # the batch's terms must average this far below chance (nats) before a span can fire


# a row whose targets are its own input tokens at this share of its terms (those not inside a run of one
# token: ``leaked``) has leaked labels. A never-shifted row is exactly 1; clean rows reach 0.48 on the dev
# half (64-byte rows of indented reST, where few terms start a token), so a short clean row stays clear of it
LEAKED = 0.9
LEAK_MIN_TERMS = 16  # ... counted on rows with at least this many such terms
LEAKED_COLUMN = "leaked_labels"  # the sample column that carries each row's leaked share to the cause


class JunkSpan(NamedTuple):
    """0-d tensors (the logits' device): the largest mean excess over chance of ``terms`` consecutive
    loss terms of one document (``-inf``: no run that long), the mean excess of all terms, and the
    largest share, over rows, of terms whose target is their own input token (``leaked``; None: no
    input ids given)."""

    span: torch.Tensor
    mean: torch.Tensor
    leak: torch.Tensor | None = None
    leak_rows: torch.Tensor | None = None  # (B,) each row's leaked-label share (``leaked``)
    where: torch.Tensor | None = None  # (2,) long: the row and first position of the run ``span`` is
    # (B, T - terms + 1): each window's mean excess (``-inf``: not a full run of one document); where a
    # firing step's junk lies, row by row (``monitor.data_flags``), read on such a step only
    windows: torch.Tensor | None = None


def term_excess(logits: torch.Tensor, targets: torch.Tensor, inputs: torch.Tensor | None) -> torch.Tensor:
    """(..., T) each term's loss minus the loss of a uniformly random token there, which is
    ``mean_v z_v - z_target`` (the log-sum-exp cancels: no softmax); a term whose target repeats its
    input token counts at most 0. ``logits`` (..., T, V) (entries at ``-inf``, a vocabulary mask, are
    not tokens the model could emit: they stay out of the mean), ``targets`` (..., T) ids (clamped:
    mask ignored terms yourself), ``inputs`` (..., T) the ids at the same positions or None."""
    V = logits.shape[-1]
    excess = term_stats(logits.reshape(-1, V), targets.reshape(-1), log_probs=False, loss=False).excess
    return cap_repeats(excess.view(targets.shape), targets, inputs)


def cap_repeats(excess: torch.Tensor, targets: torch.Tensor, inputs: torch.Tensor | None) -> torch.Tensor:
    """``excess`` with each term whose target repeats its input token capped at 0 (module doc)."""
    if inputs is None:
        return excess
    return torch.where(targets == inputs.to(targets.device), excess.clamp(max=0.0), excess)


def span_argmax(masked: torch.Tensor, valid: torch.Tensor, docs: torch.Tensor | None,
                terms: int, invalid: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The largest mean of the excess (``masked`` (..., T): zeroed where no term is, shared with the mean)
    over ``terms`` consecutive valid positions of one document (``docs`` (..., T) ids; None: one document a
    row), over every row (``-inf``, 0-d, when no such run exists), (2,) long: that run's row and first
    position, and (rows, windows) every window's mean (None when no row is that long). On the device.
    ``valid`` (..., T) bool; ``invalid``: ``~valid``, when the caller holds it."""
    T = masked.shape[-1]
    if T < terms:
        return masked.new_tensor(-torch.inf), torch.zeros(2, dtype=torch.long, device=masked.device), None
    sums = masked.unfold(-1, terms, 1).sum(-1)  # (..., T - terms + 1)
    broken = (~valid if invalid is None else invalid).unfold(-1, terms, 1).any(-1)  # a window with a non-term
    if docs is not None:  # a run stays inside one packed document
        d = docs.unfold(-1, terms, 1)
        broken |= (d != d[..., :1]).any(-1)
    means = (sums / terms).masked_fill_(broken, -torch.inf).reshape(-1, sums.shape[-1])  # (rows, windows)
    # value and place in one reduction: indexing by the 0-d argmax read it on the host, a sync on every
    # captured forward (benchmarks/gpu_check.py on an H200, the first run on a GPU)
    top, best = means.reshape(-1).max(0)
    return top, torch.stack([best // means.shape[-1], best % means.shape[-1]]), means


@torch.no_grad()
def junk_span(logits: torch.Tensor, targets: torch.Tensor, input_ids: torch.Tensor | None = None,
              document_ids: torch.Tensor | None = None, terms: int = 16) -> JunkSpan:
    """The step's junk-span statistics for ``GradMonitor.after_backward(junk_span=...)``.

    ``logits`` (B, T, V) at the model's positions; ``targets`` (B, T) the id each position's logits
    predict (already shifted), ``IGNORE`` (-100) or any negative id where a position has no loss
    term; ``input_ids`` (B, T) the ids at the same positions (repeats count at most 0; None: no such
    rule); ``document_ids`` (B, T) for packed rows (a span stays in one document). No softmax: the
    excess is ``mean(z) - z_target``, one sum over the vocabulary a block of positions at a time
    (``term_stats``): one read of the logits.
    """
    if terms < 1:
        raise ValueError(f"junk_span: terms={terms} must be at least 1 (spikes.junk_terms)")
    if logits.dim() != 3 or targets.shape != logits.shape[:2]:
        raise ValueError(f"junk_span: logits must be (B, T, V) and targets (B, T); got {tuple(logits.shape)} "
                         f"and {tuple(targets.shape)} (shift the labels so position t holds the token t+1)")
    for name, ids in (("input_ids", input_ids), ("document_ids", document_ids)):
        if ids is not None and ids.shape != targets.shape:
            raise ValueError(f"junk_span: {name} must be (B, T) like targets {tuple(targets.shape)}; "
                             f"got {tuple(ids.shape)}")
    tgt = targets.to(logits.device)
    check_ids(tgt, logits.shape[-1], "junk_span: targets")
    excess = term_excess(logits, tgt.clamp(min=0), input_ids)
    return junk_of(excess, tgt >= 0, document_ids, terms, tgt, input_ids)


def check_ids(targets: torch.Tensor, vocab: int, where: str) -> None:
    """A target id at or above the vocabulary size names the fix instead of a bare index error (on an
    accelerator, an asynchronous assertion with the same words instead of a bare device assert)."""
    msg = (f"{where} hold an id >= the logits' vocabulary size {vocab}: the targets do not belong to these "
           f"logits (a tokenizer with more ids than the model's output layer?); mark positions without a loss "
           f"term with -100")
    if targets.device.type == "cpu":
        if targets.numel() and int(targets.max()) >= vocab:
            raise ValueError(msg)
    elif targets.numel():
        torch._assert_async(targets.max() < vocab, msg)


def junk_of(excess: torch.Tensor, valid: torch.Tensor, document_ids: torch.Tensor | None, terms: int,
            targets: torch.Tensor | None = None, inputs: torch.Tensor | None = None) -> JunkSpan:
    """``JunkSpan`` from each term's excess (B, T) (``term_excess``), ``valid`` (B, T) bool, the
    document ids (B, T) or None, and the targets and input ids (B, T) for the leak share (``leaked``)."""
    rows = None if targets is None or inputs is None else leaked(targets, inputs, valid)
    return junk_stats(excess, valid, document_ids, terms, rows, valid.sum())


def junk_stats(excess: torch.Tensor, valid: torch.Tensor, document_ids: torch.Tensor | None, terms: int,
               rows: torch.Tensor | None, n_terms: torch.Tensor, *, invalid: torch.Tensor | None = None,
               clamped: bool = False) -> JunkSpan:
    """``junk_of`` from parts the caller may already hold (``watch()``'s per-step pass shares them with the
    sample signal): ``rows`` each row's leaked share (``leaked``; None: unknown), ``n_terms`` the number of
    valid terms (an integer tensor; ``clamped``: already at least 1), ``invalid`` ``~valid``."""
    docs = document_ids
    if docs is not None and docs.device != valid.device:
        docs = docs.to(valid.device)
    invalid = ~valid if invalid is None else invalid
    masked = excess.masked_fill(invalid, 0.0)  # (B, T): the runs' sums and the mean both read it
    best, where, windows = span_argmax(masked, valid, docs, terms, invalid)
    return JunkSpan(best, masked.sum() / (n_terms if clamped else n_terms.clamp(min=1)),
                    None if rows is None else rows.max(), rows, where, windows)


def rows_above(windows: torch.Tensor, margin: float) -> list[tuple[int, float, int]]:
    """(row, its largest window mean, that window's first position) of every row of ``windows`` (a
    ``JunkSpan.windows``) whose largest window is above ``margin``. One host read: a firing step's."""
    w = windows.detach().float().cpu()
    best, at = w.max(-1)
    return [(b, float(best[b]), int(at[b])) for b in (best > margin).nonzero().flatten().tolist()]


def junk_parts(junk: Any) -> list:
    """A step's junk statistics per micro-batch: a ``JunkSpan`` alone, or the sequence given (one each)."""
    return [junk] if hasattr(junk, "span") else list(junk or [])


def leaked_rows_of(column: Any) -> list[list[int]]:
    """Per micro-batch, the rows of a ``LEAKED_COLUMN`` value (a (B,) tensor, or one per micro-batch: tensors
    or lists, None where unknown) whose leaked share reaches ``LEAKED``. Host read: a spike step's."""
    parts = [column] if isinstance(column, torch.Tensor) else list(column or [])
    out = []
    for part in parts:
        vals = part.tolist() if isinstance(part, torch.Tensor) else list(part or [])
        out.append([b for b, v in enumerate(vals) if v is not None and v >= LEAKED])
    return out


def leaked(targets: torch.Tensor, inputs: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """(B,) each row's share of loss terms whose target IS its input token, among the terms whose input does
    not repeat the token before it: labels that were never shifted (``labels = inputs`` fed to a loss that
    does not shift, a collator bug), a loss the model drives to 0 by copying. Natural text holds such terms
    only where a doubled token starts (a few percent). Inside a run of one token (``=====``, indentation)
    the target repeats the input in clean text too, so those terms count on neither side of the share: a
    leaked row of indented code is 1.0, not 0.4. 0 for rows under ``LEAK_MIN_TERMS`` such terms."""
    inputs = inputs.to(targets.device)
    return leaked_shares(valid & (targets == inputs), inputs, valid)


def leaked_shares(repeat: torch.Tensor, inputs: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``leaked`` from parts the caller may already hold: ``repeat`` (B, T) bool the valid terms whose target
    is their input token, ``inputs`` (B, T) on its device, ``valid`` (B, T) bool the loss terms."""
    prev = torch.cat([inputs[:, :1] - 1, inputs[:, :-1]], 1)  # (B, T): the token before, none at 0
    fresh = inputs != prev
    count = (valid & fresh).sum(1)
    out = ((repeat & fresh).sum(1) / count.clamp(min=1)).masked_fill_(count < LEAK_MIN_TERMS, 0.0)
    return out if out.dtype == torch.float32 else out.float()
