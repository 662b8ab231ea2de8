"""Each loss term's loss and its excess over chance, for the detector's sample and junk signals, at the
cost of at most one streaming read of the logits (issue 38).

- **From the loss's own graph** (``saved_log_probs``): ``F.cross_entropy`` keeps the log-probabilities it
  computed for its backward (the input ``NllLossBackward0`` saved). A term's loss is a gather from them
  and its excess over chance, ``mean_v log p_v - log p_target`` (the log-sum-exp cancels), one sum over
  the vocabulary: no exp, no copy, nothing the step does not already hold. ``watch()`` takes this route
  whenever the model returns a cross-entropy loss over the logits it returns (HF's ``labels=``,
  nanoGPT's ``(logits, loss)``).
- **From the logits** (``term_stats(..., log_probs=False)``): per block of positions (``CPU_BLOCK`` /
  ``DEVICE_BLOCK`` elements: bounded memory, a 4096 x 152k bf16 row is never copied to fp32 whole) a sum
  of the logits for the excess and ``log_softmax`` (one fused kernel that reads the block twice and
  writes it once) for the loss, computed in fp32: fp32 and, on CUDA, fp16 logits are read as they are;
  bf16 logits are cast one block at a time first (ATen fuses only fp16 into the kernel). ``logsumexp`` is
  avoided: its max, subtraction, exp and sum are separate kernels with temporaries on a GPU, and 2.3x
  slower than ``log_softmax`` on a CPU; the value is the same.

A vocabulary mask (entries at -inf: no token the model could emit there) stays out of the mean. Its
rows' sums are not finite. On the CPU those rows alone are summed again without the masked entries, a
block of them at a time (the host reads a CPU tensor for free). On an accelerator the host must not
wait for the device every step (gpu_check at stop 50: summing every entry through ``isfinite`` /
``where`` made the saved-log-probs route 1.16x a cross-entropy forward + backward at V=128k). So the first read for a
device and vocabulary size asks the host once whether any row is masked (``_MASKING``):

- a model that masks (its vocabulary padded to -inf on every position, an RL action mask) is then
  summed over its finite entries exactly, in blocks, at every step (several passes over each block);
- a model that does not is summed once per row, and the first rows whose sums are not finite after all
  (chosen on the device, no host read: up to a ``FIX_PART``-th of the batch's rows, at least ``FIX_MIN``,
  at most a block's) are summed again without their masked entries, once for the whole batch (a tensor not
  viewable as (N, V), ``logits[:, :-1]``, is read a leading row at a time, each with this budget). A row
  beyond those counts as at chance (excess 0: the junk signal does not see it); its loss is exact.
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch

CPU_BLOCK = 1 << 22  # elements of a logits block on the CPU (16 MiB in fp32)
# elements of a block on an accelerator (128 MiB of fp32 log-probs): few blocks, few kernel launches
# (gpu_check at stop 50: 16 MiB blocks made 128 blocks of ~10 launches at V=128k, T=4096, 4-6.6x a
# cross-entropy forward + backward)
DEVICE_BLOCK = 1 << 25
# rows summed again without their masked entries on an accelerator (module doc): a 32nd of the batch's, at
# least 8, at most a block's (about a tenth of a pass more, in ~9 small kernels, once a step)
FIX_PART, FIX_MIN = 32, 8
# (device type, vocabulary size) -> did the first read there hold masked rows (module doc)
_MASKING: dict[tuple[str, int], bool] = {}
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
        if not src.shape[0]:
            return _flat_stats(src.new_zeros(0, V), target.new_zeros(0), log_probs, loss, excess)
        rows = [term_stats(src[b], target[b], log_probs=log_probs, loss=loss, excess=excess)
                for b in range(src.shape[0])]
        return TermStats(*(torch.cat(part) if part[0] is not None else None for part in zip(*rows)))
    return _flat_stats(flat, target.reshape(-1), log_probs, loss, excess)


def _flat_stats(src: torch.Tensor, target: torch.Tensor, log_probs: bool, loss: bool, excess: bool) -> TermStats:
    N, V = src.shape
    if N == 0:  # no terms (a micro-batch whose labels are all ignored): nothing to read
        empty = src.new_zeros(0, dtype=torch.float32)
        return TermStats(empty if loss else None, empty.clone() if excess else None)
    if log_probs:  # no log-sum-exp: a gather and ONE sum over the vocabulary, no temporary of (N, V)
        lt = src.gather(1, target[:, None])[:, 0].float()
        return TermStats(-lt if loss else None, _excess(src, lt) if excess else None)
    # logits: the log-softmax needs a temporary of the block; blocks bound it (few, large blocks: on a busy
    # CPU every op is a parallel region that waits for its slowest thread; on a GPU every op is a launch)
    step = _rows_per(CPU_BLOCK if _on_host(src) else DEVICE_BLOCK, V)
    plain = excess and _plain_sums(src)
    losses, at_target, sums = [], [], []
    for s in range(0, N, step):
        z = src if step >= N else src[s:s + step]  # (n, V): one block is the whole (no slice op)
        t = (target if step >= N else target[s:s + step]).unsqueeze(1)  # (n, 1)
        if excess:  # first: the sum reads the block while it is still in cache from the forward
            at_target.append(z.gather(1, t)[:, 0].float())
            if plain:
                sums.append(z.sum(-1, dtype=torch.float32))
        if loss:  # in fp32 (bf16 logits: a cast of the block first, module doc)
            losses.append(-torch.log_softmax(z, -1, dtype=torch.float32).gather(1, t)[:, 0])
    return TermStats(_join(losses) if loss else None,
                     _excess(src, _join(at_target), _join(sums) if plain else None) if excess else None)


def _join(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _excess(src: torch.Tensor, at_target: torch.Tensor, sums: torch.Tensor | None = None) -> torch.Tensor:
    """(n,) each row's mean over its finite entries minus its value at the target: the excess over chance
    (the log-sum-exp cancels, so logits and log-probabilities give the same); a masked row the device
    route left over counts as at chance (module doc). ``sums``: the rows' plain sums, when already read."""
    mean = _finite_mean(src, sums)
    if _on_host(src):
        return mean - at_target
    return torch.where(torch.isfinite(mean), mean - at_target, 0.0)


def _on_host(t: torch.Tensor) -> bool:
    """May the host read ``t`` for free (a CPU tensor: no device to wait for)?"""
    return t.device.type == "cpu"


def _plain_sums(z: torch.Tensor) -> bool:
    """Is a plain sum of each row of ``z`` wanted (every route but the device's for a model seen masking)?"""
    return _on_host(z) or not _MASKING.get((z.device.type, z.shape[-1]))


def _finite_mean(z: torch.Tensor, sums: torch.Tensor | None = None) -> torch.Tensor:
    """(n,) fp32 each row's mean over its finite entries (module doc: vocabulary masks), accumulated in
    fp32 whatever ``z``'s dtype; ``sums``: the rows' plain sums when the caller read them already. Off the
    host: exactly, in blocks of rows, for a vocabulary seen masked; else each row summed once, and the rows
    to sum again chosen on the device (``_refine_on_device``)."""
    key = (z.device.type, z.shape[-1])
    if not _plain_sums(z):  # a masking model on the device: no plain sum to waste
        return _masked_means(z, None, DEVICE_BLOCK)
    mean = (z.sum(-1, dtype=torch.float32) if sums is None else sums) / z.shape[-1]
    if _on_host(z):
        # a host read is free here: one sum says whether any row is not finite (isfinite is four kernels); a total
        # that overflows while every row is finite only costs the exact check below
        if not math.isfinite(float(mean.sum())):
            rows = (~torch.isfinite(mean)).nonzero()[:, 0]  # exactly the masked rows, a block of them at a time
            mean[rows] = _masked_means(z, rows, CPU_BLOCK)
        return mean
    if not mean.numel():
        return mean
    if key not in _MASKING:  # once per device and vocabulary size (module doc)
        _MASKING[key] = not bool(torch.isfinite(mean).all())
        if _MASKING[key]:
            return _finite_mean(z)
    return _refine_on_device(z, mean)


def _masked_mean(rows: torch.Tensor) -> torch.Tensor:
    """(k,) fp32 each row's mean over its finite entries (temporaries of ``rows``' size: callers bound it)."""
    finite = torch.isfinite(rows)
    return torch.where(finite, rows, 0.0).sum(-1, dtype=torch.float32) / finite.sum(-1).clamp(min=1)


def _masked_means(z: torch.Tensor, rows: torch.Tensor | None, block: int) -> torch.Tensor:
    """``_masked_mean`` of ``z``'s ``rows`` (None: every row), at most ``block`` elements at a time."""
    n = z.shape[0] if rows is None else rows.numel()
    if not n:
        return z.new_zeros(0, dtype=torch.float32)
    step = _rows_per(block, z.shape[-1])
    return _join([_masked_mean(z[s:s + step] if rows is None else z.index_select(0, rows[s:s + step]))
                  for s in range(0, n, step)])


def _rows_per(block: int, V: int) -> int:
    """Rows of ``V`` entries in a block of ``block`` elements (at least one)."""
    return max(1, block // max(1, V))


def _refine_on_device(z: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    """``mean`` with the first rows whose sum is not finite summed again over their finite entries: a
    ``FIX_PART``-th of the rows, at least ``FIX_MIN``, at most a block's (bounded temporaries). Chosen
    without a host read (a stable sort puts them first; finite rows among the chosen are summed again too
    and keep their value), once for the whole batch (gpu_check at stop 52: once a block, its ~12 small
    kernels and sort copies were 5.6 ms of host time a step at 8 x 1024 tokens, V = 50k); a row left over
    keeps its sum's -inf (``_excess``)."""
    n = mean.numel()
    k = min(n, max(FIX_MIN, n // FIX_PART), _rows_per(DEVICE_BLOCK, z.shape[-1]))
    bad = ~torch.isfinite(mean)
    idx = torch.sort(bad.to(torch.uint8), descending=True, stable=True).indices[:k]
    fixed = torch.where(bad[idx], _masked_mean(z.index_select(0, idx)), mean[idx])
    return mean.index_copy(0, idx, fixed)


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
