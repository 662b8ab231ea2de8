"""Skip means skip: an optimizer step on non-finite gradients leaves parameters AND state unchanged.

A clipper with ``on_nonfinite="skip"`` zeroes every gradient on such a step, which is enough for
plain SGD but not for optimizers that move weights without a gradient (AdamW's moments and weight
decay, SGD's momentum buffer): a "skipped" AdamW step still moved weights by up to 0.0086 in the
fault test. ``SkipStepGuard`` wraps any ``torch.optim.Optimizer``:

    clipper = AdaGC(model)                         # or GradMonitor(..., clipper=...)
    guard = SkipStepGuard(opt, clipper)            # mode="restore" (default) or "sync"
    loss.backward(); clipper.clip(); opt.step()    # no-op when clip() saw a non-finite gradient

- ``mode="restore"`` (no host sync): a step pre-hook copies the parameters and every optimizer
  state tensor into a scratch buffer (fused ``_foreach_copy_``); the step runs; a post-hook
  selects, on the device, the snapshot when the flag is set. The selection is done on the
  tensors' integer bit patterns (``x*(1-b) + snapshot*b``), so NaN/Inf produced by the step are
  replaced exactly: the result is bitwise the pre-step value. Cost: extra memory of one copy of
  the parameters plus the optimizer state (AdamW: 3x the parameter size) and about four fused
  passes over that memory per step. State tensors that live on the CPU while the flag is on an
  accelerator (AdamW's default ``step`` counter; use ``capturable=True`` or ``fused=True`` to keep
  it on the device) and state created by the step itself (the first step) need the flag on the
  host: one bool read, only then.
- ``mode="sync"``: ``optimizer.step`` reads the flag once (one host sync per step on an
  accelerator; free on CPU) and does not run at all when it is set. No extra memory.

The learning-rate schedule still advances on a skipped step (call it as usual). ``remove()``
undoes the guard.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable

import torch

from ..config._validate import one_of

_BITS = {torch.float32: torch.int32, torch.float64: torch.int64, torch.bfloat16: torch.int16,
         torch.float16: torch.int16}


def _flag_source(source: Any) -> Callable[[], torch.Tensor | None]:
    """A callable returning the skip flag (0-d bool tensor, True = skip) or None (never clipped)."""
    if hasattr(source, "last_nonfinite"):  # a Clipper
        return lambda: source.last_nonfinite
    clipper = getattr(source, "clipper", None)  # a GradMonitor
    if clipper is not None and hasattr(clipper, "last_nonfinite"):
        return lambda: clipper.last_nonfinite
    if callable(source):
        return source
    raise TypeError(f"SkipStepGuard(flag=...) needs a clipper, a GradMonitor with a clipper, or a callable "
                    f"returning a 0-d bool tensor (True = skip this step); got {type(source).__name__}")


def _bits(t: torch.Tensor) -> torch.Tensor | None:
    """An integer view with the same bytes (or the tensor itself for integer dtypes)."""
    if t.dtype in _BITS:
        return t.view(_BITS[t.dtype])
    if not t.dtype.is_floating_point and not t.dtype.is_complex and t.dtype != torch.bool:
        return t
    return None


class SkipStepGuard:
    def __init__(self, optimizer: torch.optim.Optimizer, flag: Any, mode: str = "restore") -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError("SkipStepGuard(optimizer=...) needs a torch.optim.Optimizer, "
                            f"got {type(optimizer).__name__}")
        one_of("mode", mode, ("restore", "sync"))
        self.optimizer, self.mode = optimizer, mode
        self._flag = _flag_source(flag)
        self.skipped = 0  # python count of steps known on the host to have been skipped (sync mode)
        self._handles: list[Any] = []
        self._orig_step = None
        if mode == "sync":
            self._orig_step = optimizer.step

            def step(*args, **kwargs):
                flag = self._flag()
                if flag is not None and bool(flag):  # host sync: one bool per step
                    self.skipped += 1
                    return None
                return self._orig_step(*args, **kwargs)

            optimizer.step = step
        else:
            self._handles = [optimizer.register_step_pre_hook(self._snapshot),
                             optimizer.register_step_post_hook(self._restore)]
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (live tensor, snapshot buffer)
        self._buffers: dict[int, torch.Tensor] = {}  # id(parameter or state tensor) -> reused scratch buffer
        self._fresh: list[torch.Tensor] = []  # params whose state the step will create
        self._python_state: list[tuple[dict, str, Any]] = []

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        if self._orig_step is not None:
            self.optimizer.step = self._orig_step
            self._orig_step = None

    # -- restore mode ---------------------------------------------------------------------
    def _live(self) -> list[tuple[int, torch.Tensor]]:
        """(stable key, tensor) for every parameter and optimizer state tensor."""
        out = []
        self._fresh, self._python_state = [], []
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                out.append((id(p), p.data))  # p.data is a new alias each time: key by the Parameter
                state = self.optimizer.state.get(p)
                if not state:
                    self._fresh.append(p)
                    continue
                for k, v in state.items():
                    if isinstance(v, torch.Tensor):
                        out.append((id(v), v))
                    else:
                        self._python_state.append((state, k, v))
        return out

    @torch.no_grad()
    def _snapshot(self, optimizer, args, kwargs) -> None:
        self._pairs = []
        live = self._live()
        by_key: dict[tuple, tuple[list, list]] = defaultdict(lambda: ([], []))
        for key, t in live:
            buf = self._buffers.get(key)
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype or buf.device != t.device:
                buf = self._buffers[key] = torch.empty_like(t, memory_format=torch.preserve_format)
            self._pairs.append((t, buf))
            dst, src = by_key[(t.device, t.dtype)]
            dst.append(buf)
            src.append(t)
        for dst, src in by_key.values():
            torch._foreach_copy_(dst, src)  # fused, one call per (device, dtype)
        live_ids = {key for key, _ in live}
        self._buffers = {k: v for k, v in self._buffers.items() if k in live_ids}

    @torch.no_grad()
    def _restore(self, optimizer, args, kwargs) -> None:
        flag = self._flag()
        if flag is None:
            return
        if self._fresh:  # state created by this step: drop it if skipped (one bool read, rare)
            if bool(flag):  # host sync: only on steps that create optimizer state
                for p in self._fresh:
                    self.optimizer.state.pop(p, None)
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
