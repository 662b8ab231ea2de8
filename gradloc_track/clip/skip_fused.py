"""``SkipStepGuard(mode="fused")``: the optimizer's own skip flag, as ``GradScaler`` uses it.

PyTorch's fused optimizers (``Adam``/``AdamW``/``SGD``/``Adagrad`` with ``fused=True``, CPU and
CUDA) read two optional device tensors set as attributes before ``step()``: ``grad_scale`` and
``found_inf``. With ``found_inf == 1`` the fused kernel updates nothing and the step counters are
put back: an exact skip with no host sync, no extra memory and no extra pass.

A step pre-hook sets ``optimizer.found_inf`` to the clipper's flag, a persistent buffer that every
``clip()`` overwrites in place (so Lightning, whose closure runs backward and clipping *inside*
``step()`` after the pre-hook, still hands the fresh flag to the kernel). Under ``GradScaler``,
whose ``step()`` sets its own ``found_inf`` before calling ``optimizer.step()``, the two flags are
combined (``max``: either one skips); its ``grad_scale`` is left alone. The post-hook puts the
attributes back as they were and clears the buffer, so a step that ran no ``clip()`` is never
skipped by a stale flag. A skipped first step drops the state it created (fused SGD's first
momentum buffer is uninitialised memory): one bool read, on that step only.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from .skip_restore import drop_fresh_state, fresh_params

_MISSING = object()


def supports_found_inf(optimizer: torch.optim.Optimizer) -> bool:
    """Every param group runs a fused kernel that honours ``optimizer.found_inf``."""
    groups = getattr(optimizer, "param_groups", None) or []
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False)) and bool(groups) and all(
        g.get("fused") for g in groups)


class FoundInfSkip:
    def __init__(self, optimizer: torch.optim.Optimizer, clipper: Any, flag: Callable[[], Any]) -> None:
        self.optimizer, self.clipper, self._flag = optimizer, clipper, flag
        self.buffer: torch.Tensor | None = None
        if clipper is not None:  # every clip() writes its flag here, in place
            device = clipper.params[0].device
            self.buffer = clipper.found_inf = torch.zeros((), dtype=torch.float32, device=device)
        self._prev: Any = _MISSING
        self._fresh: list[torch.Tensor] = []

    def _ours(self) -> torch.Tensor | None:
        if self.buffer is not None:
            return self.buffer
        flag = self._flag()
        if flag is None:
            return None
        return flag.float() if isinstance(flag, torch.Tensor) else torch.tensor(float(bool(flag)))

    @torch.no_grad()
    def before(self, optimizer, args, kwargs) -> None:
        self._fresh = fresh_params(optimizer)
        self._prev = optimizer.__dict__.get("found_inf", _MISSING)
        ours = self._ours()
        if ours is None:
            return
        prev = None if self._prev is _MISSING else self._prev
        optimizer.found_inf = ours if prev is None else torch.maximum(prev, ours.to(prev.device))

    @torch.no_grad()
    def after(self, optimizer, args, kwargs) -> None:
        flag = optimizer.__dict__.get("found_inf")
        if flag is not None:
            drop_fresh_state(optimizer, self._fresh, flag)
        if self._prev is _MISSING:
            optimizer.__dict__.pop("found_inf", None)
        else:
            optimizer.found_inf = self._prev
        self._prev, self._fresh = _MISSING, []
        if self.buffer is not None:
            self.buffer.zero_()  # consumed: a step without clip() is not skipped by this flag

    def remove(self) -> None:
        if self.clipper is not None and self.clipper.found_inf is self.buffer:
            self.clipper.found_inf = None
