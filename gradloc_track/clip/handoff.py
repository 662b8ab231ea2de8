"""What a step's clip hands to the optimizer: the non-finite flag a ``SkipStepGuard`` reads and, for a
fused optimizer, the one coefficient its kernel applies.

Both a ``Clipper`` and, where no clipper runs, the monitor's ``NonfiniteFlag`` carry this
(``StepHandoff``). A fused guard (``clip.skip_fused``) gives them two persistent 0-d fp32 buffers
and passes them to the optimizer as ``found_inf`` and ``grad_scale``:

- ``found_inf``: ``~all_finite`` of the step; the kernel updates nothing when it is 1.
- ``grad_scale``: ``1 / coef`` of a single-coefficient clip (global clipping, ZClip, AdaGC's
  global mode and its warm-up): the kernel divides every gradient by it inside its own pass, so the
  clip makes no pass of its own (``deferred``). Per-tensor coefficients are applied by the clipper.

A clip that runs before ``step()`` writes the buffers and the guard's pre-hook hands them over; a
clip that runs inside ``step()`` (Lightning's closure) finds the step open (``step_open``) and
writes into buffers the pre-hook already handed over, keeping what ``GradScaler`` put there
(flags OR-ed, scales multiplied, in place). The guard's post-hook resets everything, and a clip
whose step never came is forgotten by the next one.
"""
from __future__ import annotations

import torch


class StepHandoff:
    """The hand-over state; a clipper or a flag source mixes it in and calls ``_init_handoff``."""

    def _init_handoff(self, device: torch.device) -> None:
        self.device = device
        self.skip_guard = None  # the SkipStepGuard bound to this source, if any
        # set by a SkipStepGuard: the optimizer skips a non-finite step for real, so its gradients
        # need no zeroing (one pass less)
        self.skip_exact = False
        self.last_nonfinite: torch.Tensor | None = None  # () bool of the last step, for SkipStepGuard
        self.last_nonfinite_host: bool | None = None  # the same, when a caller already has it on the host
        self.found_inf: torch.Tensor | None = None  # () fp32 buffers of a fused guard (FoundInfSkip)
        self.grad_scale: torch.Tensor | None = None
        self.deferred: bool | None = None  # this step's scale left to the optimizer (None: no clip yet)
        self.step_open = False  # the guard's pre-hook ran before this step's clip (a closure)
        self.scale_promised: bool | None = None  # what that pre-hook told the optimizer

    @property
    def single_coef(self) -> bool:
        """Host-side: the next ``clip()`` scales every gradient by one coefficient."""
        return False

    def _hand_over(self, nonfinite: torch.Tensor, coef: torch.Tensor | None = None) -> bool:
        """Publish this step's flag, and ``coef`` (0-d) to a fused optimizer that can apply it.
        True: the optimizer's kernel applies the scale, the caller must not."""
        if not self.step_open and self.deferred is not None:  # the last clip's step never came
            self._reset_buffers()
        self.last_nonfinite, self.last_nonfinite_host = nonfinite, None
        if self.found_inf is not None:  # OR in place: a flag the pre-hook already handed over stays
            torch.maximum(self.found_inf, nonfinite.to(self.found_inf.dtype), out=self.found_inf)
        defer = (coef is not None and coef.dim() == 0 and self.grad_scale is not None
                 and self.scale_promised is not False)
        if defer:  # the kernel divides by grad_scale; a zero coefficient is a skipped step
            self.grad_scale.mul_(torch.where(coef > 0, coef.reciprocal(), 1.0))
        self.deferred = bool(self.deferred) or defer
        return defer

    def _reset_buffers(self) -> None:
        if self.found_inf is not None:
            self.found_inf.zero_()
        if self.grad_scale is not None:
            self.grad_scale.fill_(1.0)

    def step_done(self) -> None:
        """The optimizer consumed the hand-over (the guard's post-hook): start the next step clean."""
        self._reset_buffers()
        self.deferred, self.step_open, self.scale_promised = None, False, None


class NonfiniteFlag(StepHandoff):
    """The skip guard's flag where no clipper sets one (``watch(model, opt)`` with ``clip=none``,
    ``GradMonitor(optimizer=...)`` without a clipper): ``~isfinite`` of the monitor's own per-tensor
    squared norms, which it computes every step anyway. No pass over the gradients, no host sync."""

    on_nonfinite = "skip"
    skip_step = "auto"
    scales = False

    def __init__(self, device: torch.device) -> None:
        self._init_handoff(device)

    def update(self, sq_norms: torch.Tensor) -> torch.Tensor:
        """The step's flag from its (n,) squared norms (a NaN or an Inf anywhere: skip)."""
        nonfinite = ~(sq_norms < float("inf")).all()  # () device bool; NaN < inf is False
        self._hand_over(nonfinite)
        return nonfinite
