"""The step's losses are each rank's own (its batch, its forward); the gradient norms are the same on
every rank (all-reduced). A detector that fired on one rank's loss and not on another's would start
a collective localization on one rank alone: a hang. So under ``torch.distributed`` the losses the
detector reads are combined across ranks first, with ONE all-gather of a few numbers on the device
(no host sync), and every rank feeds its detector the same values:

- the step's loss: the mean of the ranks' losses (the global loss for equal micro-batches);
- the largest per-sample loss, the largest junk run and the largest leaked-label share: the largest
  over the ranks;
- the junk signal's mean excess: the mean over the ranks;
- whether the weight norm is not finite: on any rank (a bit flipped on one replica).

A rank that gave no value (no loss from its forward) is left out of that value; a value no rank gave
stays absent. NaN stays NaN (a non-finite loss on one rank fires on all).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .rank_wait import explained, waiting

# slot -> how the ranks' values combine
COMBINE = {"loss": "mean", "sample_max": "max", "junk_span": "max", "junk_mean": "mean", "junk_leak": "max",
           "weight_bad": "max"}
GIVEN = "#given"  # suffix of the slot that counts the ranks that gave a value


def world_of(group: Any) -> int:
    """The number of ranks in ``group`` (1 outside ``torch.distributed``)."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def combine_across_ranks(local: dict[str, torch.Tensor | None], device: torch.device,
                         group: Any = None) -> dict[str, torch.Tensor]:
    """``local``: every ``COMBINE`` slot, a 0-d tensor or None (not given on this rank). Returns each
    slot's combined value and, under ``slot + GIVEN``, how many ranks gave it (drop the slot when 0).
    Every rank must call this on the same steps (the detector's configuration decides, not the data)."""
    names = list(COMBINE)
    vals = torch.stack([torch.zeros((), device=device) if local.get(n) is None
                        else local[n].detach().float().reshape(()).to(device) for n in names])
    # filled on the device: a list turned into a tensor would be a host-to-device copy every step
    given = torch.stack([torch.full((), float(local.get(n) is not None), device=device) for n in names])
    mine = torch.cat([vals, given])  # (2k,)
    everyone = torch.empty(world_of(group) * mine.numel(), device=device)
    rank = dist.get_rank()  # the global rank, as the monitor's messages name it
    with waiting(f"rank {rank}'s all-gather of the spike detector's inputs at optimizer.step()"):
        try:  # gloo waits here; NCCL in the step's host transfer (``GradMonitor._sync``)
            dist.all_gather_into_tensor(everyone, mine, group=group)
        except RuntimeError as exc:  # the process group's timeout, a peer gone: name the likely cause
            raise explained(exc, rank) from exc
    rows = everyone.view(-1, 2, len(names))  # (world, 2, k)
    v, g = rows[:, 0], rows[:, 1] > 0  # (world, k)
    count = g.sum(0).float()  # (k,)
    out = {}
    for i, n in enumerate(names):
        col, ok = v[:, i], g[:, i]
        if COMBINE[n] == "mean":
            out[n] = torch.where(ok, col, 0.0).sum() / count[i].clamp(min=1.0)
        else:  # max; NaN propagates through amax
            out[n] = torch.where(ok, col, -torch.inf).amax()
        out[n + GIVEN] = count[i]
    return out
