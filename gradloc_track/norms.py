"""Fused, sync-free gradient/weight norm computation.

Everything here returns *device* tensors. Nothing calls ``.item()``/``.tolist()``: the caller
decides when (and whether) to move one stacked tensor to the host.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Sequence

import torch
import torch.distributed as dist


def _is_dtensor(t: torch.Tensor) -> bool:
    return type(t).__name__ == "DTensor" and hasattr(t, "to_local")


def local_part(t: torch.Tensor) -> torch.Tensor:
    """The shard this rank holds (a DTensor's local tensor), else the tensor itself."""
    return t.to_local() if _is_dtensor(t) else t


def is_replicated(t: torch.Tensor) -> bool:
    """True for a DTensor whose every placement is Replicate (each rank holds all of it)."""
    if not _is_dtensor(t):
        return False
    return all(type(p).__name__ == "Replicate" for p in t.placements)


def trainable_params(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """The (name, parameter) pairs every component iterates over, in one agreed order."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def _foreach_norm_fp32(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Fused L2 norms, accumulated in at least fp32 (a bf16 result keeps ~3 digits).

    All tensors share one dtype (callers group by dtype). float64 (and any dtype wider than
    fp32) is reduced in its own precision: ``dtype=float32`` would be a narrowing, which torch
    rejects with a RuntimeError.
    """
    if tensors[0].dtype in (torch.float64, torch.complex64, torch.complex128):
        return torch._foreach_norm(tensors, 2.0)
    try:
        return torch._foreach_norm(tensors, 2.0, dtype=torch.float32)
    except TypeError:  # older torch without the dtype argument: upcast (copies low-precision tensors)
        return torch._foreach_norm([t.float() for t in tensors], 2.0)


def dense_part(t: torch.Tensor) -> torch.Tensor:
    """A tensor whose L2 norm is ``t``'s: sparse COO gradients (``nn.Embedding(sparse=True)``)
    are coalesced first (duplicate indices sum), then their values are used."""
    if t.layout == torch.sparse_coo:
        return t.coalesce().values()
    if t.layout != torch.strided:
        raise TypeError(f"gradients with layout {t.layout} are not supported: use dense or sparse COO gradients")
    return t


def sq_norms(tensors: Sequence[torch.Tensor | None], device: torch.device | None = None) -> torch.Tensor:
    """Per-tensor squared L2 norms of the *local* parts, as one float32 1-D device tensor.

    ``None`` entries (parameters without a gradient) give 0. Tensors are grouped by
    (device, dtype) and each group is reduced with one ``torch._foreach_norm`` call; float64
    groups are reduced in float64, sparse COO gradients by the norm of their coalesced values.
    """
    n = len(tensors)
    if n and all(type(t) is torch.Tensor for t in tensors) and not any(t.is_sparse for t in tensors):
        # plain tensors (no DTensor, no sparse): grouped in C++, no per-tensor work in Python
        grouped = torch._C._group_tensors_by_device_and_dtype([list(tensors)], True)
        if len(grouped) == 1:
            ((dev, _dtype), ((ts,), _pos)), = grouped.items()
            norms = torch.stack(_foreach_norm_fp32(ts))  # (n,), in order
            return (norms * norms).to(device=device or dev, dtype=torch.float32)
    groups: dict[tuple, list[int]] = defaultdict(list)
    locals_: list[torch.Tensor | None] = [None if t is None else dense_part(local_part(t)) for t in tensors]
    for i, t in enumerate(locals_):
        if t is not None:
            groups[(t.device, t.dtype)].append(i)
    if device is None:
        device = next((t.device for t in locals_ if t is not None), torch.device("cpu"))
    if len(groups) == 1 and len(next(iter(groups.values()))) == n:  # common case: one group, in order
        norms = torch.stack(_foreach_norm_fp32(locals_))  # (n,) fp32 (fp64 for fp64 grads)
        return (norms * norms).to(device=device, dtype=torch.float32)
    out = torch.zeros(n, dtype=torch.float32, device=device)
    for (_dev, _dtype), idx in groups.items():
        norms = torch.stack(_foreach_norm_fp32([locals_[i] for i in idx]))  # (len(idx),)
        out.index_copy_(0, torch.tensor(idx, device=device), (norms * norms).to(device=device, dtype=torch.float32))
    return out


def all_reduce_sq_norms(
    sq: torch.Tensor, tensors: Sequence[torch.Tensor | None], group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Turn local squared norms of sharded (DTensor) tensors into global ones: one all-reduce.

    Replicated DTensors are pre-divided by the world size so the single SUM restores them;
    plain tensors (e.g. DDP, whose gradients are already averaged) need no reduction and are
    returned unchanged when no tensor is a DTensor.
    """
    if not (dist.is_available() and dist.is_initialized()):  # cheap test first: no per-tensor loop
        return sq
    if not any(t is not None and _is_dtensor(t) for t in tensors):
        return sq
    world = dist.get_world_size(group)
    scale = [1.0 / world if t is None or not _is_dtensor(t) or is_replicated(t) else 1.0 for t in tensors]
    sq = sq * torch.tensor(scale, dtype=sq.dtype, device=sq.device)  # one host->device copy, no sync
    dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=group)
    return sq


def global_sq_norms(
    tensors: Sequence[torch.Tensor | None], group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Per-tensor squared norms, reduced across ranks for sharded tensors. Device tensor."""
    return all_reduce_sq_norms(sq_norms(tensors), tensors, group)
