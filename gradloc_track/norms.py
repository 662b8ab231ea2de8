"""Fused, sync-free gradient/weight norm computation.

Everything here returns *device* tensors. Nothing calls ``.item()``/``.tolist()``: the caller
decides when (and whether) to move one stacked tensor to the host.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Sequence

import torch
import torch.distributed as dist

from .grouping import own_named_parameters


def is_distributed(group: Any = None) -> bool:
    """Is a process group of more than one rank initialized (``group``: that group, else the default one)?"""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


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
    """The (name, parameter) pairs every component iterates over, in one agreed order. Names are
    the bare eager model's (``torch.compile``'s ``_orig_mod.``, DDP's ``module.`` dropped): metric keys
    match across runs."""
    return [(n, p) for n, p in own_named_parameters(model) if p.requires_grad]


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


_PLAIN = (torch.Tensor, torch.nn.Parameter)  # exactly these types: a subclass (DTensor) takes the general path


@torch.no_grad()  # parameters may be passed as they are (a weight norm is never differentiated)
def sq_norms(tensors: Sequence[torch.Tensor | None], device: torch.device | None = None) -> torch.Tensor:
    """Per-tensor squared L2 norms of the *local* parts, as one float32 1-D device tensor.

    ``None`` entries (parameters without a gradient) give 0. Tensors are grouped by
    (device, dtype) and each group is reduced with one ``torch._foreach_norm`` call; float64
    groups are reduced in float64, sparse COO gradients by the norm of their coalesced values.
    """
    n = len(tensors)
    if n and all(type(t) in _PLAIN and t.layout == torch.strided for t in tensors):
        # plain dense tensors and parameters (no DTensor, no sparse layout of any kind): grouped in C++, no
        # per-tensor work in Python
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


def shard_groups(tensors: Sequence[torch.Tensor | None]) -> list[tuple[Any, list[int]]]:
    """(process group, tensor indices) for each mesh dimension that shards some tensor.

    A DTensor placed ``Shard``/``_StridedShard`` on mesh dim ``d`` holds 1/size(d) of itself per
    rank of that dim: its local squared norm is summed over ``mesh.get_group(d)``. ``Replicate``
    dims hold copies and are not summed. Plain tensors (DDP: already averaged, identical on every
    rank) are not reduced. Groups are listed in order of first appearance, identical on every
    rank (same parameter order), so every rank issues the same collectives in the same order.
    """
    out: dict[Any, list[int]] = {}
    for i, t in enumerate(tensors):
        if t is None or not _is_dtensor(t):
            continue
        mesh = t.device_mesh
        for d, placement in enumerate(t.placements):
            if "Shard" in type(placement).__name__ and mesh.size(d) > 1:  # Shard, _StridedShard
                out.setdefault(mesh.get_group(d), []).append(i)
    return list(out.items())


_INDEX: dict[tuple, torch.Tensor] = {}


def _device_index(idx: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """``idx`` as a device tensor, made once: a pageable host->device copy waits for the device."""
    key = (idx, str(device))
    t = _INDEX.get(key)
    if t is None:
        t = _INDEX[key] = torch.tensor(idx, device=device)
    return t


def reduce_over_shards(values: torch.Tensor, tensors: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """Sum per-tensor additive values (squared norms, dot products) of local shards over the
    ranks that shard each tensor: one all-reduce per sharding mesh dimension (ONE for FSDP2 and
    HSDP, where every tensor is sharded along the same dim), none for plain tensors."""
    if not (dist.is_available() and dist.is_initialized()):  # cheap test first: no per-tensor loop
        return values
    groups = shard_groups(tensors)
    if not groups:
        return values
    values = values.clone()
    for pg, idx in groups:
        if len(idx) == len(tensors):  # every tensor sharded along this dim: reduce in place
            dist.all_reduce(values, op=dist.ReduceOp.SUM, group=pg)
            continue
        index = _device_index(tuple(idx), values.device)
        part = values.index_select(0, index)
        dist.all_reduce(part, op=dist.ReduceOp.SUM, group=pg)
        values.index_copy_(0, index, part)
    return values


def all_reduce_sq_norms(
    sq: torch.Tensor, tensors: Sequence[torch.Tensor | None], group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Turn local squared norms of sharded (DTensor) tensors into global ones.

    Each tensor's squared norm is summed over exactly the mesh dimensions that shard it (its
    DTensor placements: ``Shard`` dims summed, ``Replicate`` dims not), with one all-reduce per
    sharding mesh dim: one per step for FSDP2 and for HSDP (replicate x shard) meshes, so every
    replica gets the same values and per-tensor clip thresholds stay identical across replicas.
    Plain tensors (DDP, whose gradients are already averaged) are returned unchanged.
    ``group`` is kept for callers that pass one; a DTensor's own mesh names its groups.
    """
    return reduce_over_shards(sq, tensors)


def global_sq_norms(
    tensors: Sequence[torch.Tensor | None], group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Per-tensor squared norms, reduced across ranks for sharded tensors. Device tensor."""
    return all_reduce_sq_norms(sq_norms(tensors), tensors, group)
