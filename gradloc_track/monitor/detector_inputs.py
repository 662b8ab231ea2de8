"""What the monitor gives the spike detector beyond the gradient norms: the step's loss and its
largest per-sample loss (as the training loop passes them), the update the optimizer is about to
make, and the parameter norm (the scale of float noise).

Only what the detector reads (``SpikeDetector.wants``) is computed, on the device, and it rides in
the step's one host transfer (``HostPack``): no extra sync.

The update signal is ``adam_update.AdamUpdate`` (Adam's next step, from its state and this step's
gradient after the clipper).
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from .adam_update import NO_CLIP, AdamUpdate, ClipScale
from .packing import HostPack

LOSS, SAMPLE_MAX, UPDATE, WEIGHT = "loss", "sample_max", "update", "weight_norm"  # HostPack slots


def as_device_value(value: Any, device: torch.device) -> torch.Tensor | None:
    """A loss given as a tensor (any device) or a number, as a 0-d fp32 tensor on ``device``."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return value.detach().reshape(-1).float().mean().to(device)
    return torch.tensor(float(value), device=device)


def sample_max(sample_losses: Any, device: torch.device) -> torch.Tensor | None:
    """The largest per-sample loss (NaN when any is NaN: ``max`` propagates it), 0-d on ``device``.
    ``sample_losses``: a (B,) tensor, a list of numbers, or one tensor per micro-batch."""
    if sample_losses is None:
        return None
    if isinstance(sample_losses, torch.Tensor):
        parts = [sample_losses]
    elif len(sample_losses) and isinstance(sample_losses[0], torch.Tensor):
        parts = list(sample_losses)
    else:
        parts = [torch.as_tensor([float(v) for v in sample_losses])]
    flat = torch.cat([p.detach().reshape(-1).float().to(device) for p in parts])
    return flat.max() if flat.numel() else None


class DetectorInputs:
    """Packs the detector's extra inputs with the step's values; ``read`` turns them into keywords
    of ``SpikeDetector.update``."""

    def __init__(self, detector: Any, optimizer: Any, params: Sequence[torch.nn.Parameter]) -> None:
        self.wants: frozenset = frozenset(getattr(detector, "wants", frozenset()))
        self.optimizer = optimizer
        self.weight_norm: float | None = None  # the last parameter norm seen (parameters move slowly)
        self._loss = self._samples = self._w_sq = None
        self.adam = AdamUpdate(optimizer) if "update" in self.wants else None
        if self.adam is not None and not self.adam.groups:
            self.adam = None  # not an Adam-like optimizer: no update signal

    def remove(self) -> None:
        """Take the update signal's step hook off the optimizer (the handle's close)."""
        if self.adam is not None:
            self.adam.remove()

    @property
    def needs_weights(self) -> bool:
        """Weight norms must be computed this step: the floor has no parameter scale yet."""
        return "weight_norm" in self.wants and self.weight_norm is None

    def stage(self, loss: Any, sample_losses: Any, w_sq: torch.Tensor | None) -> None:
        """This step's loss, per-sample losses and per-tensor squared weight norms (None: not given)."""
        self._loss, self._samples, self._w_sq = loss, sample_losses, w_sq

    def add(self, pack: HostPack, params: Sequence[torch.nn.Parameter], grad_sq: torch.Tensor,
            scale: ClipScale | None = NO_CLIP) -> None:
        """The wanted values, as device scalars, into this step's transfer. ``scale``: what the clipper
        does to the gradient before the optimizer's step (None: not known here)."""
        dev = pack.device
        if "loss" in self.wants and self._loss is not None:
            pack.add_slot(LOSS, as_device_value(self._loss, dev))
        if "sample_losses" in self.wants:
            smax = sample_max(self._samples, dev)
            if smax is not None:
                pack.add_slot(SAMPLE_MAX, smax)
        if self.adam is not None:
            u = self.adam.norm(params, grad_sq, scale)
            if u is not None:
                pack.add_slot(UPDATE, u)
        if "weight_norm" in self.wants and self._w_sq is not None:
            pack.add_slot(WEIGHT, self._w_sq.sum().sqrt())

    def read(self, slots: dict[str, float]) -> dict[str, Any]:
        """The keywords for ``SpikeDetector.update`` from the transfer's slots (``HostValues.slots``)."""
        out: dict[str, Any] = {}
        if WEIGHT in slots:
            self.weight_norm = slots[WEIGHT]
        if "weight_norm" in self.wants and self.weight_norm is not None:
            out["weight_norm"] = self.weight_norm
        if LOSS in slots:
            out["loss"] = slots[LOSS]
        if SAMPLE_MAX in slots:
            out["sample_losses"] = [slots[SAMPLE_MAX]]
        if UPDATE in slots:
            out["update"] = slots[UPDATE]
            if not math.isfinite(slots[UPDATE]) and self.adam is not None:
                self.adam.forget()  # a skipped step: the moments carried to the next step did not happen
        return out

    def update_norm(self, params: Sequence[torch.nn.Parameter], grad_sq: torch.Tensor,
                    scale: ClipScale | None = NO_CLIP) -> torch.Tensor | None:
        """The update signal alone (``AdamUpdate.norm``); None without an Adam-like optimizer."""
        return None if self.adam is None else self.adam.norm(params, grad_sq, scale)
