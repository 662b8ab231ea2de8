"""Skip means skip: an optimizer step on non-finite gradients leaves parameters AND state unchanged.

Zeroing the gradients of a bad step is enough for plain SGD but not for optimizers that move
weights without a gradient (AdamW's moments and weight decay, SGD's momentum buffer): a
"skipped" AdamW step still moved weights by up to 0.0086 in the fault test. ``SkipStepGuard``
wraps any ``torch.optim.Optimizer`` so that the step after a ``clip()`` that saw a non-finite
gradient does nothing, bitwise:

    clipper = AdaGC(model)                         # or GradMonitor(..., clipper=...)
    guard = SkipStepGuard(opt, clipper)            # mode="auto"
    loss.backward(); clipper.clip(); opt.step()    # no-op when clip() saw a non-finite gradient

``GradMonitor(optimizer=...)``, ``watch()`` and the HF/Lightning callbacks install one for you
(``clip.skip_step``, a clipper's ``skip_step=``; ``"off"`` opts out and keeps 0.2's zeroing). One
guard per clipper: a new one replaces the old. Modes:

- ``"fused"``: the optimizer's own skip flag ``found_inf`` (``fused=True`` Adam/AdamW/SGD/
  Adagrad, as ``GradScaler`` uses it): no host sync, no memory, no extra pass. A single-coefficient
  clip (GlobalClip, ZClip, AdaGC's global mode and warm-up) also goes in as the kernel's
  ``grad_scale``: the clip makes no pass of its own. Works beside ``GradScaler`` (flags OR-ed,
  scales multiplied; ``clip.skip_fused``).
- ``"sync"``: a step pre-hook reads the flag (one bool per step: a host sync on an accelerator,
  free on CPU and on steps where ``GradMonitor`` already moved its values to the host) and, when
  it is set, hands the optimizer empty param groups for that step (nothing updated, no state
  created). No memory. A closure (Lightning) is run by that hook, so the flag is this step's; a
  hook that runs the monitor inside ``step()`` must be registered before the guard.
- ``"restore"``: no host sync; a snapshot of the parameters and every optimizer state tensor is
  taken before each step and selected back, bit for bit, when the flag is set. Costs one copy of
  parameters + optimizer state (AdamW: 3x the parameter size) and ~4 fused passes over it per
  step. State created by the step itself (the first step), state kept as python numbers and
  CPU-side state with the flag on an accelerator need one bool read, only then.
- ``"auto"`` (default): ``"fused"`` when every param group is fused, else ``"sync"``.

An optimizer that steps another inside its own ``step()`` (``ZeroRedundancyOptimizer``: its
``optim``, on this rank's shard; ``optim_unwrap.stepped_optimizers``) is guarded as a whole: sync
empties the param groups of each, restore snapshots each one's parameters and state, fused
hands the flag to the innermost (whose kernel moves the weights).

With a guard on, the clipper no longer zeroes a non-finite step's gradients (the step does not
use them): one pass over the gradients less. The learning-rate schedule still advances on a
skipped step (call it as usual). ``skipped`` counts skips known on the host (sync mode).
``remove()`` undoes the guard.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from ..config._validate import one_of
from ..optim_unwrap import stepped_optimizers, unwrap_optimizer
from .skip_fused import FoundInfSkip, supports_found_inf
from .skip_restore import StateSnapshot

SKIP_MODES = ("auto", "fused", "sync", "restore")


def _clipper_of(source: Any) -> Any:
    """The clipper behind a flag source (a clipper, or a GradMonitor with one), else None."""
    if hasattr(source, "last_nonfinite"):
        return source
    clipper = getattr(source, "clipper", None)
    return clipper if clipper is not None and hasattr(clipper, "last_nonfinite") else None


def _flag_source(source: Any, clipper: Any) -> Callable[[], Any]:
    """A callable returning the skip flag (0-d bool tensor or python bool, True = skip) or None."""
    if clipper is not None:  # the host copy when a caller already moved it (no sync), else the tensor
        return lambda: clipper.last_nonfinite if clipper.last_nonfinite_host is None else clipper.last_nonfinite_host
    if callable(source):
        return source
    raise TypeError(f"SkipStepGuard(flag=...) needs a clipper, a GradMonitor with a clipper, or a callable "
                    f"returning a 0-d bool tensor (True = skip this step); got {type(source).__name__}")


def guard_for(optimizer: Any, clipper: Any) -> "SkipStepGuard | None":
    """The guard ``GradMonitor(optimizer=...)`` (and so ``watch()`` and the callbacks) installs:
    a flag source (a clipper, or the monitor's ``NonfiniteFlag`` when no clipper sets one) with
    ``on_nonfinite="skip"`` and ``skip_step`` other than ``"off"``, on a torch optimizer. None
    otherwise (a clipper then zeroes a bad step's gradients and says so once)."""
    if optimizer is None or clipper is None or getattr(clipper, "on_nonfinite", None) != "skip":
        return None
    mode = getattr(clipper, "skip_step", "auto")
    optimizer = unwrap_optimizer(optimizer)
    if mode == "off" or not isinstance(optimizer, torch.optim.Optimizer) or not hasattr(clipper, "last_nonfinite"):
        return None
    existing = clipper.skip_guard
    if existing is not None and existing.optimizer is optimizer:
        return existing
    return SkipStepGuard(optimizer, clipper, mode=mode)


def resolve_mode(optimizer: torch.optim.Optimizer, mode: str) -> str:
    one_of("mode", mode, SKIP_MODES)
    optimizer = stepped_optimizers(optimizer)[-1]  # the one whose kernel moves the weights
    fused = supports_found_inf(optimizer)
    if mode == "fused" and not fused:
        raise ValueError(f"SkipStepGuard(mode='fused'): {type(optimizer).__name__} does not run a fused kernel that "
                         "reads found_inf in every param group; build it with fused=True (Adam, AdamW, SGD, "
                         "Adagrad), or use mode='auto'")
    if mode == "auto":
        return "fused" if fused else "sync"
    return mode


class SkipStepGuard:
    def __init__(self, optimizer: torch.optim.Optimizer, flag: Any, mode: str = "auto") -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError("SkipStepGuard(optimizer=...) needs a torch.optim.Optimizer, "
                            f"got {type(optimizer).__name__}")
        self.clipper = _clipper_of(flag)
        self._flag = _flag_source(flag, self.clipper)
        self.optimizer, self.mode = optimizer, resolve_mode(optimizer, mode)
        self.stepped = stepped_optimizers(optimizer)  # it, and any optimizer its step() steps (ZeRO's optim)
        self.skipped = 0  # python count of steps known on the host to have been skipped (sync mode)
        self._handles: list[Any] = []
        self._fused: FoundInfSkip | None = None
        if self.mode == "sync":
            self._held: list[tuple[dict, list]] = []
            self._handles = [optimizer.register_step_pre_hook(self._decide),
                             optimizer.register_step_post_hook(self._release)]
        elif self.mode == "restore":
            self._snapshots = [StateSnapshot(o) for o in self.stepped]
            self._handles = [optimizer.register_step_pre_hook(self._take),
                             optimizer.register_step_post_hook(self._restore)]
        else:  # on the innermost: its kernel reads found_inf (its pre-hook runs inside the outer step)
            inner = self.stepped[-1]
            self._fused = FoundInfSkip(inner, self.clipper, self._flag)
            self._handles = [inner.register_step_pre_hook(self._fused.before),
                             inner.register_step_post_hook(self._fused.after)]
        if self.clipper is not None:
            previous = self.clipper.skip_guard
            if previous is not None:  # one guard per clipper: two would each hold the param groups
                previous.remove()
            self.clipper.skip_guard = self
            self.clipper.skip_exact = True  # the optimizer skips: no need to zero a bad step's gradients

    # -- sync mode -------------------------------------------------------------------------
    def _decide(self, optimizer, args, kwargs) -> tuple | None:
        """A step pre-hook (after any hook registered before the guard, e.g. ``watch()``'s monitor):
        read the flag; on a bad step hand the optimizer empty param groups, so it updates nothing
        and creates no state. A closure (Lightning: backward and clipping run inside it) is run
        here first, so the flag is this step's; the optimizer then gets the closure's result."""
        out = self._run_closure(args, kwargs)
        flag = self._flag()
        if flag is not None and bool(flag):  # host sync: one bool per step (free if already on the host)
            self.skipped += 1
            self._held = [(group, group["params"]) for o in self.stepped for group in o.param_groups]
            for group, _ in self._held:
                group["params"] = []
        return out

    def _run_closure(self, args: tuple, kwargs: dict) -> tuple | None:
        """(args, kwargs) with the closure already run and replaced by its result; None without one.
        ``args`` are ``step``'s own, the optimizer first: ``(optimizer, closure?)``."""
        positional = len(args) > 1 and callable(args[1])
        closure = args[1] if positional else kwargs.get("closure")
        if closure is None or isinstance(self.optimizer, torch.optim.LBFGS):  # LBFGS calls it many times
            return None
        with torch.enable_grad():
            loss = closure()

        def done():
            return loss

        if positional:
            return (args[0], done, *args[2:]), kwargs
        return args, {**kwargs, "closure": done}

    def _release(self, optimizer, args, kwargs) -> None:
        for group, params in self._held:
            group["params"] = params
        self._held = []

    def _take(self, *args) -> None:
        for snapshot in self._snapshots:
            snapshot.take()

    @torch.no_grad()
    def _restore(self, optimizer, args, kwargs) -> None:
        flag = self._flag()
        if flag is None:
            return
        if not isinstance(flag, torch.Tensor):
            flag = torch.tensor(bool(flag))
        for snapshot in reversed(self._snapshots):  # the outer's last: its parameters as they were
            snapshot.select(flag)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        if self._fused is not None:
            self._fused.remove()
        if self.clipper is not None and self.clipper.skip_guard is self:
            self.clipper.skip_exact = False
            self.clipper.skip_guard = None
