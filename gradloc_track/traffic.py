"""Memory traffic over gradient (and weight) storage, counted op by op.

On an accelerator, norms and clipping are bound by memory traffic, not arithmetic: what a step
costs is how many bytes it moves over the gradients. ``TrafficCounter`` is a ``TorchDispatchMode``
that adds up, for every ATen op, the bytes it reads from and writes to the storages it watches —
hardware-independent, so it holds for GPU runs timed nowhere. Views, detaches and dtype
reinterpretations move nothing and are left out; an op that overwrites a tensor without reading it
(``copy_``, ``zero_``, ``fill_``, an ``out=`` argument) counts as a write only.

    counter = TrafficCounter(grads=[p.grad for p in params], weights=list(params))
    with counter:
        monitor.after_backward(step)
    counter.multiples("grads")   # {"read": 1.0, "write": 0.0}: one norm pass, nothing scaled

``multiples`` divides by the watched group's own size, so ``clip_grad_norm_(foreach=True)`` reads as
``{"read": 2.0, "write": 1.0}``: 3.0 gradient sizes (norm 1, scale 2).

The fused optimizers' kernels (``_fused_adam(w)_``, ``_fused_sgd_``, ``_fused_adagrad_``) declare
their ``grads`` mutable but write them only when given a ``grad_scale`` (they store the unscaled
gradient back, CPU and CUDA alike): counted as read only without one, read+write with one.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# overwrite their mutated argument without reading it
_WRITE_ONLY = {"aten::copy_", "aten::_foreach_copy_", "aten::zero_", "aten::_foreach_zero_", "aten::fill_",
               "aten::_foreach_fill_"}
# op -> (argument, the argument without which the kernel does not write it)
_WRITTEN_ONLY_WITH = {f"aten::_fused_{name}_": ("grads", "grad_scale") for name in ("adam", "adamw", "sgd", "adagrad")}


def _storage_key(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # sparse, meta, or a wrapper subclass without storage
        return None


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _is_view(schema: Any) -> bool:
    """An op whose every output aliases an input and that mutates nothing: a view (no traffic)."""
    mutates = any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
    returns = schema.returns
    return bool(returns) and not mutates and all(r.alias_info is not None for r in returns)


class TrafficCounter(TorchDispatchMode):
    """Bytes read and written per watched group (``grads=``, ``weights=``, any name you pass)."""

    def __init__(self, **groups: Iterable[torch.Tensor | None]) -> None:
        super().__init__()
        self._group_of: dict[int, str] = {}
        self.size: dict[str, int] = {}
        for name, tensors in groups.items():
            tensors = [t for t in tensors if t is not None]
            self.size[name] = sum(_nbytes(t) for t in tensors)
            for t in tensors:
                key = _storage_key(t.detach())
                if key is not None:
                    self._group_of[key] = name
        self.bytes: dict[str, dict[str, int]] = {name: {"read": 0, "write": 0} for name in groups}
        self.ops: dict[str, dict[str, int]] = defaultdict(lambda: {"read": 0, "write": 0})  # per op name

    def reset(self) -> None:
        for v in self.bytes.values():
            v["read"] = v["write"] = 0
        self.ops.clear()

    def multiples(self, group: str) -> dict[str, float]:
        """Bytes read / written over ``group``, in multiples of the group's size."""
        size = max(1, self.size[group])
        b = self.bytes[group]
        return {"read": b["read"] / size, "write": b["write"] / size, "total": (b["read"] + b["write"]) / size}

    def _add(self, op: str, t: Any, read: bool, write: bool) -> None:
        if not isinstance(t, torch.Tensor):
            return
        group = self._group_of.get(_storage_key(t)) if t.device.type != "meta" else None
        if group is None:
            return
        n = _nbytes(t)
        for kind, on in (("read", read), ("write", write)):
            if on:
                self.bytes[group][kind] += n
                self.ops[f"{op}[{group}]"][kind] += n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        schema = func._schema
        if _is_view(schema):
            return out
        name = schema.name
        values = dict(zip((a.name for a in schema.arguments), args)) | kwargs
        unwritten = _WRITTEN_ONLY_WITH.get(name)
        if unwritten is not None and values.get(unwritten[1]) is not None:
            unwritten = None
        for arg in schema.arguments:
            if arg.name not in values:
                continue
            mutated = arg.alias_info is not None and arg.alias_info.is_write
            if unwritten is not None and arg.name == unwritten[0]:
                mutated = False  # read by the kernel, written only with a grad_scale
            is_out = arg.is_out
            read = not is_out and not (mutated and name in _WRITE_ONLY)
            leaves, _ = tree_flatten(values[arg.name])
            for t in leaves:
                self._add(name, t, read=read, write=mutated or is_out)
        return out
