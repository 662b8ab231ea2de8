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
