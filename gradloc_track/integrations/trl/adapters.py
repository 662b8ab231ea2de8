"""What ``integrations.hf.GradLocCallback`` calls when its trainer is TRL's.

``detect(callback)`` -> (trainer, "grpo" | "sft" | "trl" | None); ``make_adapter`` builds the
adapter that records the batches TRL trains on and returns the step's ``SpikeContext``; its
``report`` prints the console block naming the culprit completion (group, index, reward) or
packed document. A TRL trainer of another kind (DPO, KTO, ...) gets no adapter: monitoring,
clipping and detection only, and the callback says once that its loss is not rebuilt.
"""
from __future__ import annotations

import sys
import warnings
from typing import Any

from ..rl_columns import print_spike
from .trainer import find_trainer, is_trl, trl_kind


def detect(callback: Any) -> tuple[Any, str | None]:
    trainer = find_trainer(callback)
    if trainer is None:
        return None, None
    kind = trl_kind(trainer)
    return trainer, kind if kind is not None else ("trl" if is_trl(trainer) else None)


class _Adapter:
    """An adapter plus the console block printed after a localized spike."""

    def __init__(self, inner: Any, stream: Any = None) -> None:
        self.inner, self.stream = inner, stream

    def context(self) -> Any:
        return self.inner.context()

    def report(self, stats: Any, ctx: Any, run_dir: Any) -> None:
        """One console block per localized spike: which completion / document, which tokens."""
        print_spike(stats, ctx, run_dir, self.stream or sys.stderr)

    def remove(self) -> None:
        self.inner.remove()


def make_adapter(trainer: Any, kind: str | None, model: Any, tokenizer: Any) -> _Adapter | None:
    if kind == "grpo":
        from .grpo import GRPOAdapter

        return _Adapter(GRPOAdapter(trainer, model, tokenizer))
    if kind == "sft":
        from .sft import SFTAdapter

        return _Adapter(SFTAdapter(trainer, model, tokenizer))
    if kind == "trl":
        warnings.warn(f"gradloc-track: {type(trainer).__name__}'s loss is not rebuilt (GRPOTrainer and SFTTrainer "
                      "are): gradient norms, clipping and spike detection run, spikes are not localized",
                      UserWarning, stacklevel=3)
    return None
