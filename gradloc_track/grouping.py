"""Map parameter names to "layers" (blocks or modules) for per-layer metrics.

Default rule (``block``): a parameter belongs to the prefix up to and including the first
purely numeric component, e.g. ``transformer.h.3.attn.c_attn.weight -> transformer.h.3``;
parameters outside a numbered container belong to their module (``lm_head.weight -> lm_head``).
Names are the model's own: the component a wrapper adds (``torch.compile``'s ``_orig_mod.``, the
``module.`` of DDP / DataParallel / DeepSpeed's engine) is dropped (``own_name``), so compiled, wrapped
and plain runs log the same metric keys.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch

GROUP_MODES = ("block", "module", "tensor")
# name components a wrapper module inserts without changing the model: torch.compile's
# OptimizedModule holds the model as ``_orig_mod`` (also a compiled submodule, ``h.0._orig_mod.attn``); FSDP1 and
# activation checkpointing hold each wrapped module as ``_fsdp_wrapped_module`` / ``_checkpoint_wrapped_module``
# (torch's own state_dict drops these names the same way)
WRAPPER_PARTS = frozenset({"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})


# wrappers that hold the whole model as ``.module`` (every name gains a leading ``module.``): DDP,
# DataParallel, DeepSpeed's engine. Matched on the wrapper's class, never on a name alone: a user's
# own submodule called ``module`` keeps its name.
WRAPPER_MODULES = frozenset({"DistributedDataParallel", "DataParallel", "DeepSpeedEngine"})


# PEFT's ``PeftModel`` (LoRA and the other adapters) holds the model as ``base_model.model`` (a tuner's): a LoRA
# run logs ``grad_norm/model.layers.0`` as the full fine-tune of the same model does, and the two overlay in a
# chart. Prompt learning (prompt, prefix, p-tuning) holds the model itself as ``base_model``: not a prefix to drop
PEFT_MODELS, PEFT_PREFIX = frozenset({"PeftModel"}), "base_model.model."


def wrapper_prefix(model: torch.nn.Module) -> str:
    """What the wrappers around the model add to every name: ``"module."`` for such a wrapper (a subclass too),
    ``"base_model.model."`` for PEFT's, nested (``DDP(peft_model)``: both), a compiled one seen through
    (``torch.compile(DDP(model))``, the order torch recommends); ``""`` for a bare model."""
    prefix = ""
    while True:
        model = getattr(model, "_orig_mod", model) if type(model).__name__ == "OptimizedModule" else model
        names = {c.__name__ for c in type(model).__mro__}
        inner = getattr(model, "module", None)
        if not names.isdisjoint(WRAPPER_MODULES) and isinstance(inner, torch.nn.Module):
            prefix, model = prefix + "module.", inner
            continue
        tuner = getattr(model, "base_model", None)  # prompt learning (prompt/prefix tuning): the model itself
        inner = getattr(tuner, "model", None) if any(c.__name__ == "BaseTuner" for c in type(tuner).__mro__) else None
        if not names.isdisjoint(PEFT_MODELS) and isinstance(inner, torch.nn.Module):
            prefix, model = prefix + PEFT_PREFIX, inner
            continue
        return prefix


def own_name(name: str, prefix: str = "") -> str:
    """The name the bare, eager model gives a tensor or module: the wrappers' parts (``unwrapped_name``), then
    the wrapper's ``prefix`` (``wrapper_prefix``), dropped, so DDP, FSDP2, compiled and single-process runs log
    the same metric keys."""
    name = unwrapped_name(name)
    return name[len(prefix):] if prefix and name.startswith(prefix) else name


def own_named_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """``model.named_parameters()`` (frozen ones too) under their own names (``own_name``)."""
    prefix = wrapper_prefix(model)
    return [(own_name(n, prefix), p) for n, p in model.named_parameters()]


def saved_without_wrapper(names: list[str], current: list[str] | None = None,
                          prefixes: tuple[str, ...] = ("module.", PEFT_PREFIX)) -> list[str]:
    """Names a checkpoint saved before a wrapper's part was dropped, as they read now: every one of them
    starting with DDP's ``module.`` (a wrapper's, not a user's submodule among others) loses it, then PEFT's
    ``base_model.model.`` likewise (saved before stop 57). A prefix the ``current`` names start with too is the
    model's own (a user's submodule called ``base_model``): kept."""
    for prefix in prefixes:
        own = current is not None and any(n.startswith(prefix) for n in current)
        if names and not own and all(n.startswith(prefix) for n in names):
            names = [n[len(prefix):] for n in names]
    return names


def unwrapped_name(name: str) -> str:
    """``_orig_mod.h.0.attn.weight -> h.0.attn.weight``: the name the eager model gives the tensor."""
    parts = name.split(".")
    return name if WRAPPER_PARTS.isdisjoint(parts) else ".".join(p for p in parts if p not in WRAPPER_PARTS)


def layer_of(name: str, mode: str = "block", patterns: Mapping[str, str] | None = None) -> str:
    """The layer name a parameter is reported under."""
    name = unwrapped_name(name)
    if patterns:
        for layer, pattern in patterns.items():
            if re.search(pattern, name):
                return layer
    parts = name.split(".")
    if mode == "tensor":
        return name
    if mode == "block":
        for i, p in enumerate(parts[:-1]):
            if p.isdigit():
                return ".".join(parts[: i + 1])
    if mode not in GROUP_MODES:
        raise ValueError(f"monitor.group_by={mode!r} is not one of {GROUP_MODES}")
    return ".".join(parts[:-1]) if len(parts) > 1 else name


@dataclass
class LayerGrouping:
    """Fixed assignment of tensors to layers, with a device index for fused group sums."""

    names: list[str]
    layers: list[str]  # unique layer names, in first-seen order
    index: list[int] = field(default_factory=list)  # tensor i -> layer index
    # device -> index tensor, built once: no host->device copy per step
    _index_t: dict = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def build(
        cls, names: Sequence[str], mode: str = "block", patterns: Mapping[str, str] | None = None
    ) -> "LayerGrouping":
        layers: list[str] = []
        pos: dict[str, int] = {}
        index = []
        for n in names:
            lay = layer_of(n, mode, patterns)
            if lay not in pos:
                pos[lay] = len(layers)
                layers.append(lay)
            index.append(pos[lay])
        return cls(list(names), layers, index)

    def members(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {lay: [] for lay in self.layers}
        for n, i in zip(self.names, self.index):
            out[self.layers[i]].append(n)
        return out

    def sum_by_layer(self, per_tensor: torch.Tensor) -> torch.Tensor:
        """Sum a per-tensor device vector into a per-layer device vector (no host sync)."""
        idx = self._index_t.get(per_tensor.device)
        if idx is None:
            idx = self._index_t[per_tensor.device] = torch.as_tensor(self.index, device=per_tensor.device)
        out = torch.zeros(len(self.layers), dtype=per_tensor.dtype, device=per_tensor.device)
        return out.index_add_(0, idx, per_tensor)
