"""Record the micro-batches of one ``forward_backward_batch``: verl's own split, not ours.

While recording, the engine's ``forward_step`` is wrapped by an instance attribute (the class is
untouched): each training micro-batch is kept with the RNG state saved right before its forward
(probes replay its dropout) and the detached per-token outputs of that forward (``log_probs``,
``entropy``), which ``forward_backward_batch`` would otherwise drop. Dynamic batch sizes,
``same_micro_num_in_dp`` and the micro-batch order are verl's.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

from ...localizer.probe import save_rng
from .layout import MicroBatch

OUTPUTS = ("log_probs", "entropy")


class StepRecorder:
    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.batches: list[MicroBatch] = []

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        engine, had_own = self.engine, "forward_step" in vars(self.engine)
        original = engine.forward_step

        def forward_step(micro_batch, loss_function=None, forward_only=False):
            if forward_only:
                return original(micro_batch, loss_function=loss_function, forward_only=forward_only)
            mb = MicroBatch(micro_batch, save_rng())  # right before the forward: probes replay its dropout
            loss, meta = original(micro_batch, loss_function=loss_function, forward_only=forward_only)
            out = meta.get("model_output") or {} if isinstance(meta, dict) else {}
            mb.outputs = {k: out[k] for k in OUTPUTS if out.get(k) is not None}
            self.batches.append(mb)
            return loss, meta

        engine.forward_step = forward_step
        try:
            yield
        finally:
            if had_own:
                engine.forward_step = original
            else:
                del engine.forward_step

    def take(self) -> list[MicroBatch]:
        batches, self.batches = self.batches, []
        return batches
