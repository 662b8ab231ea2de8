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
from typing import Any, Callable

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
        if stats is None or not stats.events or stats.locate is None or ctx is None:
            return
        from ...console import TrainConsole

        result, shown = stats.locate_view or (stats.locate, ctx)
        try:
            TrainConsole(stream=self.stream or sys.stderr, rich=False).spike(
                stats.step, stats.events, result, shown.tokenizer, shown.input_ids, run_dir, describe=describer(shown))
        except Exception as exc:  # printing never kills training
            warnings.warn(f"gradloc-track: could not print the spike block: {exc!r}")

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


def _at(value: Any, mb: int | None) -> Any:
    return value[mb] if mb is not None and isinstance(value, (list, tuple)) else value


def describer(ctx: Any) -> Callable[[int | None, int, int], str | None]:
    """``describe(micro_batch, sample, position)`` for the console: completion or document."""
    sc = getattr(ctx, "sample_columns", None) or {}
    docs = getattr(ctx, "document_ids", None)

    def describe(mb: int | None, sample: int, position: int) -> str | None:
        where = (f"micro-batch {mb}, " if mb is not None else "") + f"sample {sample}"
        if "group" in sc and "index" in sc:
            g, i = int(_at(sc["group"], mb)[sample]), int(_at(sc["index"], mb)[sample])
            reward = f", reward {float(_at(sc['reward'], mb)[sample]):.4g}" if "reward" in sc else ""
            return f"completion {i} of group {g}{reward} ({where})"
        d = _at(docs, mb)
        if d is not None:
            return f"document {int(d[sample, position])} ({where})"
        return None

    return describe
