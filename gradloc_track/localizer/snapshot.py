"""Leave no trace: what localization touches is saved first and restored exactly afterwards."""
from __future__ import annotations

import torch

from ..norms import local_part
from .probe import restore_rng, save_rng


class Snapshot:
    """Gradients (bitwise, ``None`` kept ``None``), module buffers (BatchNorm running stats and
    ``num_batches_tracked``, bitwise), RNG state, train/eval modes, requires_grad flags.

    Gradients are kept by reference, not copied: every probe sets ``.grad = None`` first, so
    backward writes fresh buffers and the saved ones are never touched (no gradient-sized
    copy). ``copy_grads=True`` is for wrappers whose backward writes into existing gradient
    storage in place (e.g. DDP with ``gradient_as_bucket_view=True``).
    """

    def __init__(self, model: torch.nn.Module, copy_grads: bool = False) -> None:
        self.model = model
        self.params = list(model.parameters())
        self.grads = [None if p.grad is None else (p.grad.detach().clone() if copy_grads else p.grad)
                      for p in self.params]
        self.requires_grad = [p.requires_grad for p in self.params]
        self.modes = {m: m.training for m in model.modules()}
        # (module, name, the buffer object, a copy of its value)
        self.buffers = [(m, n, b, b.detach().clone())
                        for m in model.modules() for n, b in m._buffers.items() if b is not None]
        self.rng = save_rng()

    def grads_for(self, params: list[torch.nn.Parameter]) -> list[torch.Tensor | None] | None:
        """The saved ``.grad`` of each of ``params`` (the step's gradient, before localizing);
        None when the model held no gradient at all. A DTensor (FSDP2 on one process) gives its local
        tensor, as the probes do (``probe._dense``)."""
        by_id = {id(p): None if g is None else local_part(g) for p, g in zip(self.params, self.grads)}
        out = [by_id.get(id(p)) for p in params]
        return None if all(g is None for g in out) else out

    def restore(self) -> None:
        for p, g, rg in zip(self.params, self.grads, self.requires_grad):
            p.grad = g
            p.requires_grad_(rg)
        for m, training in self.modes.items():
            m.training = training
        with torch.no_grad():
            for m, name, buf, saved in self.buffers:
                m._buffers[name] = buf  # a module that replaced the tensor gets the original back
                # always copied back: BatchNorm's kernel updates running stats without bumping
                # the tensor's version counter, so "was it written?" cannot be asked cheaply
                buf.copy_(saved)
        restore_rng(self.rng)
