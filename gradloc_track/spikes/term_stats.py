"""Each loss term's loss and its excess over chance, for the detector's sample and junk signals, at the
cost of at most one streaming read of the logits (issue 38).

- **From the loss's own graph** (``saved_log_probs``): ``F.cross_entropy`` keeps the log-probabilities it
  computed for its backward (the input ``NllLossBackward0`` saved). A term's loss is a gather from them
  and its excess over chance, ``mean_v log p_v - log p_target`` (the log-sum-exp cancels), one sum over
  the vocabulary: no exp, no copy, nothing the step does not already hold. ``watch()`` takes this route
  whenever the model returns a cross-entropy loss over the logits it returns (HF's ``labels=``,
  nanoGPT's ``(logits, loss)``).
- **From the logits** (``term_stats(..., log_probs=False)``): a log-sum-exp and a sum per block of
  positions (``CPU_BLOCK`` / ``DEVICE_BLOCK`` elements: bounded memory, a 4096 x 152k bf16 row is never
  copied to fp32 whole): one read of the logits from memory, the log-sum-exp's own passes over a block
  in cache on an accelerator. On a CPU the loss is gathered from ``log_softmax`` of the block instead
  (one fused kernel, 2.3x faster there than ``logsumexp``'s max, exp and sum; the same value).

A vocabulary mask (entries at -inf: no token the model could emit there) stays out of the mean. Its
rows' sums are not finite: on the CPU those rows alone are summed again without the masked entries (the
host reads a CPU tensor for free); on an accelerator every block is summed over its finite entries
(no host read to choose), a few more passes over a block that is still in cache.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import torch

CPU_BLOCK = 1 << 22  # elements of a logits block on the CPU (16 MiB in fp32)
DEVICE_BLOCK = 1 << 22  # elements of a block on an accelerator (16 MiB in fp32: inside an H100's L2)
_PASS_THROUGH = frozenset({"ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0", "SliceBackward0",
                           "ToCopyBackward0", "CloneBackward0", "AliasBackward0", "TBackward0",
                           "SelectBackward0", "SqueezeBackward0", "SqueezeBackward1", "UnsqueezeBackward0"})


class TermStats(NamedTuple):
    """(N,) fp32 per term, each None when not asked: its loss ``-log p_target`` and its excess over
    chance ``mean_v log p_v - log p_target`` (> 0: the model rates the target below a random token)."""

    loss: torch.Tensor | None
    excess: torch.Tensor | None


@torch.no_grad()
def term_stats(src: torch.Tensor, target: torch.Tensor, *, log_probs: bool, loss: bool = True,
               excess: bool = True) -> TermStats:
    """``src`` (..., V) logits, or log-probabilities (``log_probs=True``: the loss is a gather, no
    log-sum-exp); ``target`` (...) ids in [0, V) (clamp ignored terms yourself); the stats come back
    flat, (N,). One read of ``src``; a strided ``src`` (``logits[:, :-1]``) is read row by row, never
    copied whole."""
    V = src.shape[-1]
    try:
        flat = src.view(-1, V)
    except RuntimeError:  # not viewable as (N, V): one leading row at a time
        rows = [term_stats(src[b], target[b], log_probs=log_probs, loss=loss, excess=excess)
                for b in range(src.shape[0])]
        return TermStats(*(torch.cat(part) if part[0] is not None else None for part in zip(*rows)))
    return _flat_stats(flat, target.reshape(-1), log_probs, loss, excess)


def _flat_stats(src: torch.Tensor, target: torch.Tensor, log_probs: bool, loss: bool, excess: bool) -> TermStats:
    N, V = src.shape
    if log_probs:  # no log-sum-exp: a gather and ONE sum over the vocabulary, no temporary of (N, V)
        lt = src.gather(1, target[:, None])[:, 0].float()
        return TermStats(-lt if loss else None, _finite_mean(src) - lt if excess else None)
    # logits: the log-sum-exp needs a temporary of the block; blocks bound it (few, large blocks: on a busy
    # CPU every op is a parallel region that waits for its slowest thread)
    cpu = src.device.type == "cpu"
    step = max(1, (CPU_BLOCK if cpu else DEVICE_BLOCK) // max(1, V))
    losses, excesses = [], []
    for s in range(0, N, step):
        z = src if step >= N else src[s:s + step]  # (n, V): one block is the whole (no slice op)
        z = z if z.dtype == torch.float32 else z.float()  # a copy only when the logits are not fp32
        t = (target if step >= N else target[s:s + step]).unsqueeze(1)  # (n, 1)
        zt = z.gather(1, t)[:, 0]  # (n,)
        if excess:  # first: the sum reads the block while it is still in cache from the forward
            excesses.append(_finite_mean(z) - zt)
        if loss:  # on a CPU log_softmax's one fused kernel is 2.3x faster than logsumexp's max, exp and sum
            losses.append(-torch.log_softmax(z, -1).gather(1, t)[:, 0] if cpu else torch.logsumexp(z, -1) - zt)
    return TermStats(_join(losses) if loss else None, _join(excesses) if excess else None)


def _join(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _finite_mean(z: torch.Tensor) -> torch.Tensor:
    """(n,) fp32 each row's mean over its finite entries (module doc: vocabulary masks), accumulated in
    fp32 whatever ``z``'s dtype (no copy)."""
    if z.device.type != "cpu":
        finite = torch.isfinite(z)
        return torch.where(finite, z, 0.0).sum(-1, dtype=torch.float32) / finite.sum(-1).clamp(min=1)
    mean = z.sum(-1, dtype=torch.float32) / z.shape[-1]
    if not bool(torch.isfinite(mean).all()):  # a CPU tensor: no device to wait for
        bad = ~torch.isfinite(mean)
        rows = z[bad].float()
        finite = torch.isfinite(rows)
        mean[bad] = torch.where(finite, rows, 0.0).sum(-1) / finite.sum(-1).clamp(min=1)
    return mean


class SavedLogProbs(NamedTuple):
    """What a cross-entropy over the logits kept for its backward: log-probabilities (N, V), the
    targets (N,) and the ignored id."""

    log_probs: torch.Tensor
    target: torch.Tensor
    ignore_index: int


def saved_log_probs(loss: Any, logits: torch.Tensor) -> SavedLogProbs | None:
    """The log-probabilities ``loss``'s cross-entropy computed from ``logits`` (module doc), or None
    when ``loss`` is not such a cross-entropy (another loss, class weights, a compiled graph, a graph
    already freed by backward): the caller then reads the logits."""
    start = getattr(loss, "grad_fn", None)
    if start is None or getattr(logits, "grad_fn", None) is None:
        return None
    node = _find_nll(start)
    if node is None:
        return None
    try:
        logp, target, weight = node._saved_self, node._saved_target, node._saved_weight
        ignore = int(node._saved_ignore_index)
    except (AttributeError, RuntimeError):  # RuntimeError: the saved tensors were freed (after backward)
        return None
    if weight is not None or logp.dim() != 2 or logp.shape[-1] != logits.shape[-1] or target.dim() != 1:
        return None
    source = node.next_functions[0][0]
    if source is None or type(source).__name__ != "LogSoftmaxBackward0" or not _reaches(source, logits.grad_fn):
        return None
    return SavedLogProbs(logp, target, ignore)


def _find_nll(node: Any, depth: int = 4) -> Any:
    """The ``NllLossBackward0`` node within ``depth`` steps of the loss (a division by the normaliser,
    a sum, a mean, a multiplication by a constant lie between), or None."""
    frontier = [node]
    for _ in range(depth):
        nxt = []
        for n in frontier:
            if type(n).__name__ == "NllLossBackward0":
                return n
            nxt += [f for f, _ in n.next_functions if f is not None]
        frontier = nxt
    return None


def _reaches(node: Any, target: Any, hops: int = 8) -> bool:
    """Does ``node``'s one input lead to ``target`` through views, slices and dtype casts only?"""
    for _ in range(hops):
        inputs = [f for f, _ in node.next_functions if f is not None]
        if len(inputs) != 1:
            return False
        node = inputs[0]
        if node is target:
            return True
        if type(node).__name__ not in _PASS_THROUGH:
            return False
    return False
