"""Count the bytes of tensors allocated inside a block, to check what localization holds.

``TensorMemoryMeter`` is a ``TorchDispatchMode``: every op's fresh output storage (not a view
of an input) is counted while it lives, so ``peak`` is the most tensor memory the block held at
once, on any device, forward and backward included (a CPU backward runs on the calling thread,
where the mode is active). Used by the localizer's memory test and benchmark; it slows every op,
so it is a measuring tool, not something to leave on.
"""
from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class TensorMemoryMeter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, int] = {}  # storage data_ptr -> bytes
        self.current = 0
        self.peak = 0

    def _freed(self, key: int) -> None:
        self.current -= self._live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key, size = storage.data_ptr(), storage.nbytes()
            if size == 0 or key in inputs or key in self._live:  # a view, an in-place result, or seen
                continue
            self._live[key] = size
            self.current += size
            self.peak = max(self.peak, self.current)
            weakref.finalize(storage, self._freed, key)  # storages keep their Python object alive
        return out
