"""``SkipStepGuard(mode="fused")``: the optimizer's own skip flag and scale, as ``GradScaler`` uses them.

PyTorch's fused optimizers (``Adam``/``AdamW``/``SGD``/``Adagrad`` with ``fused=True``, CPU and
CUDA) read two optional device tensors set as attributes before ``step()``: ``found_inf`` and
``grad_scale``. With ``found_inf == 1`` the fused kernel updates nothing and the step counters are
put back: an exact skip with no host sync, no extra memory and no extra pass. ``grad_scale``: the
kernel divides every gradient by it (and writes the result back to ``.grad``) inside its own pass,
so a single-coefficient clip rides along as ``grad_scale = 1 / coef`` instead of a pass of its own.

A step pre-hook hands over the persistent buffers the clip writes (``clip.handoff``): ``found_inf``
always, ``grad_scale`` when this step's clip left its scale to the optimizer. A clip that runs
*inside* ``step()`` (Lightning's closure, after the pre-hook) writes into the buffers already
handed over; the pre-hook then tells the optimizer a scale is coming when the clipper's next clip
is a single coefficient (``single_coef``). Under ``GradScaler``, whose ``step()`` sets its own
``found_inf`` and ``grad_scale`` before calling ``optimizer.step()``, the flags are OR-ed and the
scales multiplied (in our buffers, in place). The post-hook puts the attributes back as they were
and resets the buffers, so a step that ran no clip is never skipped or scaled by a stale value. A
skipped first step drops the state it created (fused SGD's first momentum buffer is uninitialised
memory): one bool read, on that step only.

The scale is handed over only where the kernel's scale reaches exactly the clipper's gradients:
every parameter the optimizer trains is one the clipper clips, and none is a DTensor (FSDP2) —
otherwise the clipper scales the gradients itself, as without a fused optimizer.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from .skip_restore import drop_fresh_state, fresh_params

_MISSING = object()


def supports_found_inf(optimizer: torch.optim.Optimizer) -> bool:
    """Every param group runs a fused kernel that honours ``optimizer.found_inf`` and ``grad_scale``."""
    groups = getattr(optimizer, "param_groups", None) or []
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False)) and bool(groups) and all(
        g.get("fused") for g in groups)


def _trained(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]


def scale_reaches_the_clipper(optimizer: torch.optim.Optimizer, clipper: Any) -> bool:
    """The kernel's ``grad_scale`` would scale exactly the clipper's gradients: every trained parameter
    of the optimizer is clipped by it, and all are plain tensors (a DTensor's kernel is sharded)."""
    if not getattr(clipper, "scales", False) or not hasattr(clipper, "params"):
        return False
    trained = _trained(optimizer)
    clipped = {id(p) for p in clipper.params}
    return all(id(p) in clipped and not hasattr(p, "to_local") for p in trained)


class FoundInfSkip:
    def __init__(self, optimizer: torch.optim.Optimizer, clipper: Any, flag: Callable[[], Any]) -> None:
        self.optimizer, self.clipper, self._flag = optimizer, clipper, flag
        self.buffer: torch.Tensor | None = None
        self.scale: torch.Tensor | None = None
        if clipper is not None:  # every clip() writes its flag (and scale) here, in place
            device = clipper.device
            self.buffer = clipper.found_inf = torch.zeros((), dtype=torch.float32, device=device)
            clipper.step_done()
            self._n_params = -1
            self._refresh_scale()
        self._prev: Any = _MISSING
        self._prev_scale: Any = _MISSING
        self._fresh: list[torch.Tensor] = []

    def _refresh_scale(self) -> None:
        """(Re)decide whether the kernel applies the clipper's scale: at construction, and after a step
        that changed the optimizer's parameter count (``add_param_group``)."""
        n = sum(len(g["params"]) for g in self.optimizer.param_groups)
        if n == self._n_params:
            return
        self._n_params = n
        ok = scale_reaches_the_clipper(self.optimizer, self.clipper)
        if ok and self.scale is None:
            self.scale = self.clipper.grad_scale = torch.ones((), dtype=torch.float32, device=self.clipper.device)
        elif not ok and self.scale is not None:
            self.scale = self.clipper.grad_scale = None

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
        self._prev_scale = optimizer.__dict__.get("grad_scale", _MISSING)
        prev = None if self._prev is _MISSING else self._prev
        if self.buffer is None:  # a plain flag callable: combine into a new tensor
            ours = self._ours()
            if ours is not None:
                optimizer.found_inf = ours if prev is None else torch.maximum(prev, ours.to(prev.device))
            return
        if prev is not None:  # GradScaler's flag: OR-ed into ours, in place (a clip inside step() adds its own)
            torch.maximum(self.buffer, prev.to(self.buffer.device, self.buffer.dtype), out=self.buffer)
        optimizer.found_inf = self.buffer
        self._hand_scale(optimizer)

    def _hand_scale(self, optimizer) -> None:
        """``optimizer.grad_scale`` = our buffer (times GradScaler's) when the kernel applies the clip."""
        c = self.clipper
        if c.deferred is None:  # no clip yet: it runs inside step(), say now what it will do
            c.step_open = True
            c.scale_promised = self.scale is not None and bool(c.single_coef)
            scaled = c.scale_promised
        else:
            scaled = bool(c.deferred)
        if not scaled or self.scale is None:
            return
        prev = None if self._prev_scale is _MISSING else self._prev_scale
        if prev is not None:  # GradScaler's scale: the kernel divides by the product
            self.scale.mul_(prev.to(self.scale.device, self.scale.dtype))
        optimizer.grad_scale = self.scale

    @torch.no_grad()
    def after(self, optimizer, args, kwargs) -> None:
        flag = optimizer.__dict__.get("found_inf")
        if flag is not None:
            drop_fresh_state(optimizer, self._fresh, flag)
        for name, prev in (("found_inf", self._prev), ("grad_scale", self._prev_scale)):
            if prev is _MISSING:
                optimizer.__dict__.pop(name, None)
            else:
                setattr(optimizer, name, prev)
        self._prev, self._prev_scale, self._fresh = _MISSING, _MISSING, []
        if self.clipper is not None:
            self.clipper.step_done()  # consumed: a step without clip() is neither skipped nor scaled by it
            self._refresh_scale()  # O(param groups): a group added since changes who the kernel scales

    def remove(self) -> None:
        c = self.clipper
        if c is not None and c.found_inf is self.buffer:
            c.found_inf = None
        if c is not None and self.scale is not None and c.grad_scale is self.scale:
            c.grad_scale = None
