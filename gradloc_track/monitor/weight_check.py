"""A corrupted weight: one incident, named by parameter, index and value, not one NaN event per step.

One weight whose exponent bit flips (0.012 -> 4e36: silent data corruption, a bad checkpoint shard, an
optimizer that wrote a NaN) makes every later forward non-finite. The skip guard drops each such step,
so the weight never heals: the detector fires on every step, and the non-finite search, replaying the
batch, finds every sample's loss NaN and blames the data (issue 37); behind an RMSNorm the outputs can
stay finite while the loss is ruined for good. On every detected step ``scan`` reads every parameter
once (a max-abs and a norm per tensor, one host transfer): a tensor holding a non-finite value, or one
``ABSURD_RATIO`` times the rms of the rest of its tensor and above ``ABSURD_MIN``, is corrupt. The cause
then names it (``CorruptWeight.detail``) and tells the run to stop and roll back; while that tensor
stays corrupt (``still``: one tensor read) later detected steps are that incident's aftermath, not
localized again. The scan runs before the localizer: a batch replayed through a corrupt weight has every
sample's gradient non-finite, and naming them all put clean samples in the culprit table and the ledger's
blocklist (held-out tester, stop 52).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..grouping import own_named_parameters
from ..norms import is_distributed, local_part

ABSURD_RATIO = 1e4  # |w| this many times the rms of the rest of its tensor...
ABSURD_MIN = 1e3  # ...and above this: no trained weight is (weights sit around 1e-2 to 1e1)


@dataclass(frozen=True)
class CorruptWeight:
    name: str  # the parameter, as model.named_parameters() names it
    index: tuple[int, ...]
    value: float
    step: int  # the detected step it was found at

    @property
    def detail(self) -> str:
        where = f"{self.name}[{', '.join(map(str, self.index))}]"
        what = "is not a number" if not math.isfinite(self.value) else "is absurd"
        return (f"a weight {what}: {where} = {self.value:.3g} (a flipped bit, a bad checkpoint, an optimizer "
                f"that wrote it); every forward from here reads it (non-finite, or finite but wrong behind a "
                f"norm layer), so stop the run and roll back to a checkpoint saved before step {self.step}")


def _bad(max_abs: float, norm: float, numel: int) -> bool:
    if not (math.isfinite(max_abs) and math.isfinite(norm)):
        return True
    rest = math.sqrt(max(0.0, norm * norm - max_abs * max_abs) / max(1, numel - 1))
    return max_abs > ABSURD_MIN and max_abs > ABSURD_RATIO * rest


def scan_all(model: torch.nn.Module, step: int, group: Any = None) -> CorruptWeight | None:
    """``scan`` on every rank, agreed (a sharded weight is corrupt on the rank holding its shard; every rank
    must take the same path next, since localizing is a collective): the first rank's finding."""
    found = scan(model, step)
    if not is_distributed(group):
        return found
    every: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, found, group=group)  # a numeric step's one small collective
    return next((f for f in every if f is not None), None)


def still_all(model: torch.nn.Module, found: CorruptWeight, group: Any = None) -> bool:
    """``still`` agreed across ranks (any rank's shard still corrupt)."""
    flag = still(model, found)
    if not is_distributed(group):
        return flag
    t = torch.tensor([float(flag)], device=_device(model))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return bool(t.item())


def _device(model: torch.nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return torch.device("cpu") if p is None else local_part(p.detach()).device


@torch.no_grad()
def scan(model: torch.nn.Module, step: int) -> CorruptWeight | None:
    """The first corrupt weight of ``model``'s parameters held here (module doc), or None."""
    named = [(n, local_part(p.detach())) for n, p in own_named_parameters(model) if p.numel()]
    if not named:
        return None
    tensors = [t for _, t in named]
    max_abs = torch._foreach_norm(tensors, math.inf)
    norms = torch._foreach_norm(tensors, 2.0)
    vals = torch.stack([torch.stack([a.float().cpu(), b.float().cpu()]) for a, b in zip(max_abs, norms)]).tolist()
    for (name, t), (a, n) in zip(named, vals):  # host sync above: a numeric step's one read of the weights
        if _bad(a, n, t.numel()):
            return _locate(name, t, step)
    return None


def _locate(name: str, t: torch.Tensor, step: int) -> CorruptWeight:
    flat = t.reshape(-1).float()
    bad = ~torch.isfinite(flat)
    pos = int(bad.nonzero()[0]) if bool(bad.any()) else int(flat.abs().argmax())
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(pos), t.shape)) if t.dim() else ()
    return CorruptWeight(name, index, float(flat[pos]), step)


def still(model: torch.nn.Module, found: CorruptWeight) -> bool:
    """Is the weight ``found`` named still corrupt here (one tensor read)?"""
    p = dict(own_named_parameters(model)).get(found.name)
    if p is None:
        return False
    t = local_part(p.detach())
    if t.numel() == 0:
        return False
    return _bad(float(t.abs().max()), float(t.float().norm()), t.numel())


def corrupt_cause_words(found: CorruptWeight, step: int) -> str:
    """The sentence of a later step of the incident."""
    if step == found.step:
        return found.detail
    return f"aftermath of step {found.step} (numeric): {found.detail}"


def why_not_localized(found: Any) -> str:
    return f"a weight is corrupt since step {found.step} ({found.name}): the batch is not the cause"
