"""``watch()`` under ``torch.amp.GradScaler`` with a fused optimizer.

``scaler.step(opt)`` unscales the gradients first for most optimizers, but a fused one (``fused=True``
Adam/AdamW/SGD/Adagrad, HF Trainer's default) gets the scale handed over instead
(``optimizer.grad_scale``) and divides inside its kernel. ``watch()``'s step pre-hook runs inside
that ``step()``, before the kernel: without ``scaler.unscale_(opt)`` in the loop, the monitor would log
loss-scaled norms (x65536 at GradScaler's default) and the clipper clip in scaled units (measured on
CPU: ``max_norm=0.5`` clipped to 0.5 / 1024 at a scale of 1024). So the hook does what
``scaler.unscale_`` does: the gradients are divided by the scale in place (one pass, on the device, no
sync) and the step's ``grad_scale`` is taken off, so the kernel does not divide again. GradScaler
checked the scaled gradients for Inf/NaN before the step and sets its ``found_inf`` as always.
"""
from __future__ import annotations

from typing import Any

import torch


@torch.no_grad()
def unscale_handed_scale(optimizer: Any) -> bool:
    """Divide ``optimizer``'s gradients by the ``grad_scale`` a GradScaler handed its fused step, and
    take it off; False (nothing done) when there is none (gradients already unscaled, or no scaler)."""
    scale = optimizer.__dict__.get("grad_scale")
    if not isinstance(scale, torch.Tensor):
        return False
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None and not p.grad.is_sparse:
                by_device.setdefault(p.grad.device, []).append(p.grad)
    for device, grads in by_device.items():
        torch._foreach_mul_(grads, scale.to(device=device, dtype=torch.float32).reciprocal())
    optimizer.grad_scale = None  # GradScaler deletes the attribute after the step, as it set it
    return True


class ScalerWatch:
    """``watch(..., scaler=scaler)``: a non-fused optimizer is never stepped on a step the scaler skips for
    its overflow, so no step hook sees it; ``scaler.update()``, called once per step either way, does. When
    the scaler's own record says it skipped (its ``step()`` ran for an optimizer and found Inf/NaN) and the
    optimizer did not step, the step is handed to the handle, its non-finite gradient still in ``.grad``:
    logged as ``train/skipped_step`` and counted, as a fused optimizer's is, so the step numbers follow the
    loop's. An ``update()`` with no skip behind it (called per micro-batch, or with no ``step()``) is no step.
    (Held-out tester round 12; a first version guessed skipped steps from gradients gone at the next forward,
    which FSDP2's and DeepSpeed's accumulation also do: the reviewer's round.) ``remove()`` puts ``update``
    back; a copy or a pickle of the scaler gets its plain ``update`` (``_Plain``), never the watch."""

    def __init__(self, scaler: Any, on_skip: Any) -> None:
        import weakref

        self.scaler = scaler
        self._own = scaler.__dict__.get("update")  # an instance attribute someone set before us, if any
        self._ours = _Watched(scaler, weakref.WeakMethod(on_skip))
        scaler.update = self._ours

    def remove(self) -> None:
        self._ours.on_skip = None  # a wrapper of someone else's on top keeps calling it: it does nothing now
        if self.scaler.__dict__.get("update") is not self._ours:
            return  # wrapped again since, by someone else: leave theirs in place
        if self._own is None or (isinstance(self._own, _Watched) and self._own.on_skip is None):
            del self.scaler.update  # (the one under ours: a watch removed meanwhile, inert)
        else:
            self.scaler.update = self._own


def skipped_by(scaler: Any) -> bool:
    """Did ``scaler.step()`` run since the last ``update()`` and find Inf/NaN (so it skipped the step)? Read from
    GradScaler's own per-optimizer record (one host read, on a step the optimizer did not take); False when
    the record is not there to read (another scaler class)."""
    states = getattr(scaler, "_per_optimizer_states", None)
    if not isinstance(states, dict):
        return False
    for state in states.values():
        if getattr(state.get("stage"), "name", None) == "STEPPED":
            found = state.get("found_inf_per_device") or {}
            if any(float(v) > 0 for v in found.values()):
                return True
    return False


class _Watched:
    """The scaler's ``update`` while watched: tells the handle first (``on_skip``: a weak method, None once
    removed), then updates."""

    def __init__(self, scaler: Any, on_skip: Any) -> None:
        self.scaler, self.on_skip = scaler, on_skip

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        callback = self.on_skip() if self.on_skip is not None else None
        if callback is not None:
            callback()
        return type(self.scaler).update(self.scaler, *args, **kwargs)

    def __deepcopy__(self, memo: dict) -> "_Plain":
        return _Plain(memo.get(id(self.scaler), self.scaler))  # the copy's own scaler, unwatched

    def __reduce__(self) -> tuple:
        return _Plain, (self.scaler,)


class _Plain:
    """A copied or unpickled scaler's ``update``: its class's, on it, watching nothing."""

    def __init__(self, scaler: Any) -> None:
        self.scaler = scaler

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return type(self.scaler).update(self.scaler, *args, **kwargs)


def watch_scaler(scaler: Any, handle: Any) -> ScalerWatch:
    return ScalerWatch(scaler, handle._scaler_update)
