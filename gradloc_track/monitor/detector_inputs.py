"""What the monitor gives the spike detector beyond the gradient norms: the step's loss and its
largest per-sample loss (as the training loop passes them), the update the optimizer is about to
make, and the parameter norm (the scale of float noise).

Only what the detector reads (``SpikeDetector.wants``) is computed, on the device, and it rides in
the step's one host transfer (``HostPack``): no extra sync.

The update signal, for an Adam-like optimizer (``betas`` in its param groups, ``exp_avg`` and
``exp_avg_sq`` in its state: Adam, AdamW, fused or not): the norm of the step Adam is about to take,
at tensor granularity, ``u^2 = sum_i lr_i^2 ||m_i'||^2 / mean(v_i')`` with ``m' = b1 m + (1 - b1) g``,
``v' = b2 v + (1 - b2) g^2`` and Adam's bias corrections, from per-tensor sums (``||m||^2``,
``<m, g>``, ``sum v``) and the step's own squared norms. It jumps with the learning rate, and when a
tensor's second moment has decayed below a normal gradient ("Adaptive Preconditioners Trigger Loss
Spikes in Adam", 2025); Adam's momentum smooths a one-step gradient spike out of it. Cost: one read of
``exp_avg`` and ``exp_avg_sq`` and a dot product with the gradient per tensor, no temporary buffer.
A row of a tensor decaying alone (a rare token's embedding) is below its resolution; sharded
(DTensor) state is skipped (its local sums are not the tensor's); weight decay is left out.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from ..norms import _is_dtensor
from .packing import HostPack

LOSS, SAMPLE_MAX, UPDATE, WEIGHT = "loss", "sample_max", "update", "weight_norm"  # HostPack slots
EPS2 = 1e-16  # Adam's eps (1e-8) squared: the floor under a tensor's second moment


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
        self._groups = _param_groups(optimizer) if "update" in self.wants else {}

    @property
    def needs_weights(self) -> bool:
        """Weight norms must be computed this step: the floor has no parameter scale yet."""
        return "weight_norm" in self.wants and self.weight_norm is None

    def stage(self, loss: Any, sample_losses: Any, w_sq: torch.Tensor | None) -> None:
        """This step's loss, per-sample losses and per-tensor squared weight norms (None: not given)."""
        self._loss, self._samples, self._w_sq = loss, sample_losses, w_sq

    def add(self, pack: HostPack, params: Sequence[torch.nn.Parameter], grad_sq: torch.Tensor) -> None:
        """The wanted values, as device scalars, into this step's transfer."""
        dev = pack.device
        if "loss" in self.wants and self._loss is not None:
            pack.add_slot(LOSS, as_device_value(self._loss, dev))
        if "sample_losses" in self.wants:
            smax = sample_max(self._samples, dev)
            if smax is not None:
                pack.add_slot(SAMPLE_MAX, smax)
        if "update" in self.wants and self._groups:
            u = self.update_norm(params, grad_sq)
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
        return out

    @torch.no_grad()
    def update_norm(self, params: Sequence[torch.nn.Parameter], grad_sq: torch.Tensor) -> torch.Tensor | None:
        """The norm of the update Adam is about to make, at tensor granularity (0-d, device). No host
        read: a step counter or learning rate kept as a tensor is used where it lies."""
        dev = grad_sq.device
        f32 = dict(device=dev, dtype=torch.float32)
        idx, ms, vs, gs, which, groups = [], [], [], [], [], {}
        for i, p in enumerate(params):
            group = self._groups.get(p)
            st = self.optimizer.state.get(p) if group is not None else None
            if not st or "exp_avg_sq" not in st or "exp_avg" not in st or "step" not in st or p.grad is None:
                continue
            m, v = st["exp_avg"], st["exp_avg_sq"]
            if _is_dtensor(v) or v.numel() == 0 or p.grad.is_sparse or m.shape != p.grad.shape:
                continue
            k = groups.setdefault(id(group), (len(groups), group, st["step"]))[0]  # the group's step counter
            idx.append(i)
            ms.append(m)
            vs.append(v)
            gs.append(p.grad)
            which.append(k)
        if not vs:
            return None
        coef = torch.stack([_group_coef(g, step, f32) for _, g, step in groups.values()])  # (G, 3)
        per = coef[torch.tensor(which, device=dev)]  # (k, 3): coefficient, b1, b2 of each tensor's group
        c, b1, b2 = per[:, 0], per[:, 1], per[:, 2]
        m_sq = torch.stack([x.to(**f32) for x in torch._foreach_norm(ms, 2)]) ** 2  # (k,) ||m||^2
        v_sum = torch.stack([x.to(**f32) for x in torch._foreach_norm(vs, 1)])  # (k,) sum of v (v >= 0)
        mg = torch.stack([torch.dot(m.reshape(-1), g.reshape(-1).to(m.dtype)).to(**f32) for m, g in zip(ms, gs)])
        g_sq = grad_sq[torch.tensor(idx, device=dev)].float()  # (k,) ||g||^2, as backward left it
        n = torch.tensor([float(v.numel()) for v in vs], **f32)
        m_new = b1 * b1 * m_sq + 2 * b1 * (1 - b1) * mg + (1 - b1) ** 2 * g_sq  # ||b1 m + (1 - b1) g||^2
        v_new = b2 * v_sum + (1 - b2) * g_sq + EPS2 * n  # sum of b2 v + (1 - b2) g^2, floored at Adam's eps
        return (c * n * m_new / v_new).sum().sqrt()


def _group_coef(group: dict, step: Any, f32: dict) -> torch.Tensor:
    """(lr^2 (1 - b2^t) / (1 - b1^t)^2, b1, b2) of a param group, t = its step counter + 1: Adam's bias
    corrections of the step about to be taken, computed where the counter lies (no host read)."""
    b1, b2 = group["betas"]
    t = torch.as_tensor(step, dtype=torch.float32).to(f32["device"]) + 1
    lr = torch.as_tensor(group["lr"], dtype=torch.float32).to(f32["device"])
    coef = lr * lr * (1 - b2 ** t) / (1 - b1 ** t) ** 2
    return torch.stack([coef.reshape(()), torch.tensor(float(b1), **f32), torch.tensor(float(b2), **f32)])


def _param_groups(optimizer: Any) -> dict[torch.nn.Parameter, dict]:
    """Each parameter's param group, for optimizers with Adam's ``betas`` (others: none)."""
    out = {}
    for group in getattr(optimizer, "param_groups", []):
        if "betas" not in group:
            continue
        for p in group["params"]:
            out[p] = group
    return out
