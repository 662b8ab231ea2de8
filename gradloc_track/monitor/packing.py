"""The one host transfer of a step: every value to log, gathered as named device values.

One ``torch.cat(...).tolist()`` moves them all, so a logging step waits for the device once.
Metrics (``add``) and internal slots (``add_slot``: the learning rate when it is a tensor, the spike
context's token count, the detector's inputs) ride in the same transfer and come back apart
(``HostValues.metrics`` / ``.slots``): a slot can never be logged as a metric by mistake.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

N_TOKENS, LR, WD = "n_tokens", "lr", "weight_decay"  # internal slots (``HostValues.slots``), never logged


@dataclass
class HostValues:
    """One transfer's values on the host: the metrics, and the internal slots apart from them."""

    metrics: dict[str, float] = field(default_factory=dict)
    slots: dict[str, float] = field(default_factory=dict)


class HostPack:
    """Collects named device values so one ``torch.cat(...).tolist()`` moves them all."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.keys: list[tuple[bool, str]] = []  # (is a slot, name) per value, in the order added
        self._scalar: list[bool] = []  # per value: it came as a 0-d tensor (in ``_scalars``, else in ``parts``)
        self.parts: list[torch.Tensor] = []  # 1-D values
        self._scalars: list[torch.Tensor] = []  # 0-d values: ONE stack at the transfer, not a reshape each

    def add(self, keys: list[str], values: torch.Tensor) -> None:
        """Metric values, one per key."""
        self._add([(False, k) for k in keys], values)

    def add_slot(self, name: str, value: torch.Tensor) -> None:
        """One internal value (a 0-d or 1-element tensor) that rides along and is never logged."""
        self._add([(True, name)], value)

    def add_slot_if_tensor(self, name: str, value: Any) -> None:
        """A value known only on the device (a capturable optimizer's tensor lr) rides along."""
        if isinstance(value, torch.Tensor):
            self.add_slot(name, value)

    def _add(self, keys: list[tuple[bool, str]], values: torch.Tensor) -> None:
        self.keys += keys
        if values.requires_grad:
            values = values.detach()
        if values.dtype != torch.float32 or values.device != self.device:
            values = values.to(self.device, torch.float32)
        if values.dim() == 0:
            self._scalar.append(True)
            self._scalars.append(values)
            return
        if values.dim() != 1:
            values = values.reshape(-1)
        self._scalar += [False] * len(keys)
        self.parts.append(values)

    def to_host(self) -> HostValues:
        tensors = self.parts + ([torch.stack(self._scalars)] if self._scalars else [])
        flat = (tensors[0] if len(tensors) == 1 else torch.cat(tensors)).tolist()  # THE host sync of this step
        n_vec = len(flat) - len(self._scalars)  # the 1-D values first, then the stacked 0-d ones
        vec, scalars = iter(flat[:n_vec]), iter(flat[n_vec:])
        out = HostValues()
        for (is_slot, name), scalar in zip(self.keys, self._scalar):
            (out.slots if is_slot else out.metrics)[name] = next(scalars) if scalar else next(vec)
        return out


def add_norms(pack: HostPack, params: Any, grad_sq: torch.Tensor, w_sq: torch.Tensor | None,
              clip_result: Any) -> None:
    """Global, per-layer and per-tensor grad norms; weight norms and ratios; the clip metrics. One
    vector of squared sums and one square root (a few ops whatever the number of layers)."""
    L = len(params.layer_keys)
    # per-tensor norms always travel (n floats): GradStats.grad_norms then needs no 2nd sync
    parts = [grad_sq.sum().reshape(1), params.grouping.sum_by_layer(grad_sq), grad_sq]  # (1,), (L,), (n,)
    if w_sq is not None:
        parts += [w_sq.sum().reshape(1), params.grouping.sum_by_layer(w_sq)]
    norms = torch.cat(parts).sqrt()  # (1 + L + n [+ 1 + L],)
    if w_sq is None:
        pack.add(params.grad_keys, norms)
    else:
        ratios = norms[1:1 + L] / norms[-L:].clamp_min(1e-12)  # (L,) ||g|| / ||w|| of each layer
        pack.add(params.grad_weight_keys, torch.cat([norms, ratios]))
    # squared norms are >= 0 or NaN: finite exactly when below inf (isfinite is four kernels, this one)
    pack.add(["grad_norm/nonfinite"], (grad_sq < torch.inf).logical_not_().sum(dtype=torch.float32))
    if clip_result is not None:
        add_clip(pack, params, clip_result)


def add_clip(pack: HostPack, params: Any, clip_result: Any) -> None:
    """The clipper's metrics (thresholds, coefficients, pre/post norms, saturation)."""
    from ..clip.metrics import clip_metrics

    cm = clip_metrics(clip_result, params.clip_grouping)  # {key: 0-d device tensor}
    pack.add(list(cm), torch.stack([v.to(pack.device, torch.float32).reshape(()) for v in cm.values()]))


def loggable(host: dict[str, float], per_tensor: bool) -> dict[str, float]:
    """The host values that are metrics (per-tensor norms only when asked for; a clip threshold
    that is not in force, NaN, is left out rather than drawn)."""
    from ..clip.metrics import THRESHOLD_PREFIX

    return {k: v for k, v in host.items() if (per_tensor or not k.startswith("grad_norm/tensor/"))
            and not (v != v and k.startswith(THRESHOLD_PREFIX))}
