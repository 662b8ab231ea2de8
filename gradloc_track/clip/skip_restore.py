"""``SkipStepGuard(mode="restore")``'s machinery: snapshot before the step, select after it.

A step pre-hook copies the parameters and every optimizer state tensor into scratch buffers
(fused ``_foreach_copy_``, one call per (device, dtype)); after the step the snapshot is
selected, on the device, where the flag is set. The selection runs on the tensors' integer bit
patterns (``x*(1-b) + snapshot*b``), so NaN/Inf produced by the step are replaced exactly: the
result is bitwise the pre-step value. Cost: one copy of the parameters plus the optimizer state
(AdamW: 3x the parameter size) and about four fused passes over that memory per step.
"""
from __future__ import annotations

from collections import defaultdict

import torch

_BITS = {torch.float32: torch.int32, torch.float64: torch.int64, torch.bfloat16: torch.int16,
         torch.float16: torch.int16}


def _bits(t: torch.Tensor) -> torch.Tensor | None:
    """An integer view with the same bytes (or the tensor itself for integer dtypes)."""
    if t.dtype in _BITS:
        return t.view(_BITS[t.dtype])
    if not t.dtype.is_floating_point and not t.dtype.is_complex and t.dtype != torch.bool:
        return t
    return None


def fresh_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Parameters with no optimizer state yet: the next step creates theirs."""
    return [p for group in optimizer.param_groups for p in group["params"] if not optimizer.state.get(p)]


def drop_fresh_state(optimizer: torch.optim.Optimizer, fresh: list[torch.Tensor], flag: torch.Tensor | bool) -> None:
    """A skipped step must not leave the state it created (fused SGD's first momentum buffer is
    uninitialised memory). Only on steps that create state."""
    if fresh and bool(flag):  # host sync: only on steps that create optimizer state (the first)
        for p in fresh:
            optimizer.state.pop(p, None)


class StateSnapshot:
    """Scratch copies of an optimizer's parameters and state, reused from step to step."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (live tensor, snapshot buffer)
        self._buffers: dict[int, torch.Tensor] = {}  # id(parameter or state tensor) -> scratch buffer
        self.fresh: list[torch.Tensor] = []  # params whose state the step will create
        self._python_state: list[tuple[dict, str, object]] = []

    def _live(self) -> list[tuple[int, torch.Tensor]]:
        """(stable key, tensor) for every parameter and optimizer state tensor."""
        out = []
        self.fresh, self._python_state = [], []
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                out.append((id(p), p.data))  # p.data is a new alias each time: key by the Parameter
                state = self.optimizer.state.get(p)
                if not state:
                    self.fresh.append(p)
                    continue
                for k, v in state.items():
                    if isinstance(v, torch.Tensor):
                        out.append((id(v), v))
                    else:
                        self._python_state.append((state, k, v))
        return out

    @torch.no_grad()
    def take(self) -> None:
        self._pairs = []
        live = self._live()
        by_key: dict[tuple, tuple[list, list]] = defaultdict(lambda: ([], []))
        seen: set[int] = set()
        for key, t in live:
            if key in seen:  # one tensor in two parameters' state: restored once (twice would add its bits)
                continue
            seen.add(key)
            buf = self._buffers.get(key)
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype or buf.device != t.device:
                buf = self._buffers[key] = torch.empty_like(t, memory_format=torch.preserve_format)
            self._pairs.append((t, buf))
            dst, src = by_key[(t.device, t.dtype)]
            dst.append(buf)
            src.append(t)
        for dst, src in by_key.values():
            torch._foreach_copy_(dst, src)  # fused, one call per (device, dtype)
        self._buffers = {k: v for k, v in self._buffers.items() if k in seen}

    @torch.no_grad()
    def select(self, flag: torch.Tensor) -> None:
        """Every tensor <- its snapshot where ``flag`` (0-d bool) is set, bit for bit; else kept."""
        drop_fresh_state(self.optimizer, self.fresh, flag)
        if self._python_state and bool(flag):  # host sync: only optimizers keeping python numbers in state
            for state, k, v in self._python_state:
                state[k] = v
        groups: dict[tuple, tuple[list, list]] = defaultdict(lambda: ([], []))
        for live, snap in self._pairs:
            lb, sb = _bits(live), _bits(snap)
            if lb is None:  # bool/complex state: rare, per tensor
                live.copy_(torch.where(flag.to(live.device), snap, live))
                continue
            dl, ds = groups[(live.device, lb.dtype)]
            dl.append(lb)
            ds.append(sb)
        for (dev, dtype), (dl, ds) in groups.items():
            b = flag.to(device=dev, dtype=dtype)  # a CPU tensor with the flag on a GPU: a sync
            torch._foreach_mul_(dl, 1 - b)  # live * (1 - b): kept or exact zero bits
            torch._foreach_mul_(ds, b)  # snapshot * b
            torch._foreach_add_(dl, ds)  # exactly one of the two, bit for bit
