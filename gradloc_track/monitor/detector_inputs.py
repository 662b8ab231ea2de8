"""What the monitor gives the spike detector beyond the gradient norms: the step's loss and its
largest per-sample loss (as the training loop passes them), the update the optimizer is about to
make, the parameter norm (the scale of float noise) and the junk-span statistics (``spikes/junk.py``).

Only what the detector reads (``SpikeDetector.wants``) is computed, on the device, and it rides in
the step's one host transfer (``HostPack``): no extra sync.

The update signal is ``adam_update.AdamUpdate`` (Adam's step from its state and the gradient after the
clipper: on an ordinary step the last optimizer step's, measured after it without reading the gradients;
this step's, measured before it, when the host sees it move differently: see its module doc). Under
``torch.distributed`` the losses are combined across ranks first (``rank_inputs``): every rank's detector
reads the same values and decides alike.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from .adam_update import NO_CLIP, AdamUpdate, ClipScale
from .packing import HostPack
from .rank_inputs import GIVEN, combine_across_ranks, world_of

LOSS, SAMPLE_MAX, UPDATE, WEIGHT = "loss", "sample_max", "update", "weight_norm"  # HostPack slots
WEIGHT_BAD = "weight_bad"  # the weight norm is not finite (on any rank): the monitor scans the weights
JUNK_SPAN, JUNK_MEAN, JUNK_LEAK = "junk_span", "junk_mean", "junk_leak"


def as_device_value(value: Any, device: torch.device) -> torch.Tensor | None:
    """A loss given as a tensor (any device) or a number, as a 0-d fp32 tensor on ``device``."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        if value.dim() == 0 and value.dtype == torch.float32 and value.device == device:
            return value.detach() if value.requires_grad else value  # as it is (the common case: no op)
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
    if len(parts) == 1 and parts[0].numel() == 1:  # one micro-batch's largest already: as it is
        return as_device_value(parts[0].reshape(()), device)
    flat = torch.cat([p.detach().reshape(-1).float().to(device) for p in parts])
    return flat.max() if flat.numel() else None


def _is_pair(x: Any) -> bool:
    """One micro-batch's (span, mean[, leak]): a ``JunkSpan`` or two or three numbers / 0-d tensors."""
    def scalar(v: Any) -> bool:
        return v is None or isinstance(v, (int, float)) or (isinstance(v, torch.Tensor) and v.dim() == 0)

    return hasattr(x, "span") or (isinstance(x, (tuple, list)) and len(x) in (2, 3) and all(map(scalar, x)))


def junk_pair(junk: Any, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """The step's (largest run's excess, mean excess, largest leaked-label share or None) as 0-d tensors
    on ``device``: the largest run and leak of the micro-batches and the mean of their means. ``junk``: a
    ``JunkSpan`` (or two or three numbers or 0-d tensors), or a list of them, one per micro-batch."""
    parts = [] if junk is None else [junk] if _is_pair(junk) else list(junk)
    if not parts:
        return None
    if len(parts) == 1:  # one micro-batch: its values as they are
        p = parts[0]
        return (as_device_value(p[0], device), as_device_value(p[1], device),
                as_device_value(p[2], device) if len(p) > 2 else None)
    spans = torch.stack([as_device_value(p[0], device) for p in parts])
    means = torch.stack([as_device_value(p[1], device) for p in parts])
    leaks = [as_device_value(p[2], device) for p in parts if len(p) > 2 and p[2] is not None]
    return spans.max(), means.mean(), torch.stack(leaks).max() if leaks else None


class DetectorInputs:
    """Packs the detector's extra inputs with the step's values; ``read`` turns them into keywords
    of ``SpikeDetector.update``."""

    def __init__(self, detector: Any, optimizer: Any, params: Sequence[torch.nn.Parameter],
                 process_group: Any = None) -> None:
        self.wants: frozenset = frozenset(getattr(detector, "wants", frozenset()))
        self.process_group = process_group
        self.optimizer = optimizer
        self.weight_norm: float | None = None  # the last parameter norm seen (parameters move slowly)
        self._loss = self._samples = self._w_sq = self._junk = None
        self.gathered = False  # this step's values were all-gathered across ranks (``rank_inputs``)
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

    def stage(self, loss: Any, sample_losses: Any, w_sq: torch.Tensor | None, junk: Any = None) -> None:
        """This step's loss, per-sample losses, per-tensor squared weight norms and junk-span
        statistics (None: not given)."""
        self._loss, self._samples, self._w_sq, self._junk = loss, sample_losses, w_sq, junk

    def add(self, pack: HostPack, params: Sequence[torch.nn.Parameter], grad_sq: torch.Tensor,
            scale: ClipScale | None = NO_CLIP) -> None:
        """The wanted values, as device scalars, into this step's transfer. ``scale``: what the clipper
        does to the gradient before the optimizer's step (None: not known here)."""
        dev = pack.device
        local: dict[str, torch.Tensor | None] = {}
        if "loss" in self.wants:
            local[LOSS] = as_device_value(self._loss, dev)
        if "sample_losses" in self.wants:
            local[SAMPLE_MAX] = sample_max(self._samples, dev)
        if "junk_span" in self.wants:
            local[JUNK_SPAN], local[JUNK_MEAN], local[JUNK_LEAK] = junk_pair(self._junk, dev) or (None, None, None)
        if self._w_sq is not None:  # squared norms are >= 0 or NaN: finite exactly when below inf
            local[WEIGHT_BAD] = (self._w_sq.sum() < torch.inf).logical_not().float()
        self.gathered = bool(local) and world_of(self.process_group) > 1
        if self.gathered:  # every rank's detector reads the same values
            for name, value in combine_across_ranks(local, dev, self.process_group).items():
                pack.add_slot(name, value)
        else:
            for name, value in local.items():
                if value is not None:
                    pack.add_slot(name, value)
        if self.adam is not None:
            u = self.adam.signal(params, grad_sq, scale)
            if u is not None:
                pack.add_slot(UPDATE, u)
        if "weight_norm" in self.wants and self._w_sq is not None:
            pack.add_slot(WEIGHT, self._w_sq.sum().sqrt())

    def read(self, slots: dict[str, float], nonfinite: bool = False) -> dict[str, Any]:
        """The keywords for ``SpikeDetector.update`` from the transfer's slots (``HostValues.slots``).
        ``nonfinite``: this step's gradient is not finite (the guard skips its optimizer step)."""
        out: dict[str, Any] = {}
        slots = {k: v for k, v in slots.items() if slots.get(k + GIVEN, 1.0) > 0}  # no rank gave it: absent
        if WEIGHT in slots:
            self.weight_norm = slots[WEIGHT]
        if "weight_norm" in self.wants and self.weight_norm is not None:
            out["weight_norm"] = self.weight_norm
        if LOSS in slots:
            out["loss"] = slots[LOSS]
        if SAMPLE_MAX in slots:
            out["sample_losses"] = [slots[SAMPLE_MAX]]
        if JUNK_SPAN in slots and JUNK_MEAN in slots:
            leak = (slots[JUNK_LEAK],) if JUNK_LEAK in slots else ()
            out["junk_span"] = (slots[JUNK_SPAN], slots[JUNK_MEAN], *leak)
        if UPDATE in slots:
            out["update"] = slots[UPDATE]
        if slots.get(WEIGHT_BAD, 0.0) > 0:  # the monitor's, not the detector's (``GradMonitor._detect`` takes it)
            out[WEIGHT_BAD] = True
        if self.adam is not None and (nonfinite or not math.isfinite(slots.get(UPDATE, 0.0))):
            self.adam.forget()  # a skipped step: nothing to measure after it, the state is read afresh
        return out

    def fired(self) -> None:
        """The detector fired on this step: its update is not fed to the next step's verdict."""
        if self.adam is not None:
            self.adam.fired()

    def update_norm(self, params: Sequence[torch.nn.Parameter], grad_sq: torch.Tensor,
                    scale: ClipScale | None = NO_CLIP) -> torch.Tensor | None:
        """The update signal alone (``AdamUpdate.norm``); None without an Adam-like optimizer."""
        return None if self.adam is None else self.adam.norm(params, grad_sq, scale)
