"""What ``integrations.hf.GradLocCallback`` calls when its trainer is TRL's.

``detect(callback)`` -> (trainer, "grpo" | "sft" | "trl" | None); ``make_adapter`` builds the
``TRLAdapter`` that records the batches TRL trains on and returns the step's ``SpikeContext``
(the console names the culprit completion, with its group and reward, or packed document, from
that context). Detection only (monitoring, clipping and spike detection; no localization), said
once and on the console of every spike (``why_not``):

- a TRL trainer of another kind (DPO, KTO, ...): its loss is not rebuilt;
- a ``GRPOTrainer`` / ``SFTTrainer`` subclass that overrides a method computing the loss (TRL's
  ``GMPOTrainer``, a user's ``compute_loss``): its loss is its own, never rebuilt as GRPO's;
- a trainer whose first micro-batch's loss differs from the rebuild's (``grpo.GRPOAdapter``'s
  check: another TRL version, a patched instance).
"""
from __future__ import annotations

import warnings
from typing import Any

from .trainer import find_trainer, is_trl, own_loss, trl_kind


def detect(callback: Any) -> tuple[Any, str | None]:
    trainer = find_trainer(callback)
    if trainer is None:
        return None, None
    kind = trl_kind(trainer)
    return trainer, kind if kind is not None else ("trl" if is_trl(trainer) else None)


class TRLAdapter:
    """The adapter of a TRL trainer: ``context()`` after the step's last backward, ``why_not()`` why
    a spike is not localized when the adapter knows, ``remove()`` at train end. ``inner`` None:
    detection only, for the reason ``why``."""

    def __init__(self, inner: Any, why: str | None = None) -> None:
        self.inner, self.why = inner, why

    def context(self) -> Any:
        return self.inner.context() if self.inner is not None else None

    def why_not(self) -> str | None:
        if self.inner is None:
            return self.why
        return getattr(self.inner, "skipped", None)

    def remove(self) -> None:
        if self.inner is not None:
            self.inner.remove()


def detection_only(trainer: Any, why: str) -> TRLAdapter:
    warnings.warn(f"gradloc-track: {why}; gradient norms, clipping and spike detection run, spikes are not "
                  "localized", UserWarning, stacklevel=4)
    return TRLAdapter(None, why)


def make_adapter(trainer: Any, kind: str | None, model: Any, tokenizer: Any) -> TRLAdapter | None:
    if kind in ("grpo", "sft"):
        why = own_loss(trainer, kind)
        if why is not None:
            return detection_only(trainer, why)
    if kind == "grpo":
        from .grpo import GRPOAdapter

        return TRLAdapter(GRPOAdapter(trainer, model, tokenizer))
    if kind == "sft":
        from .sft import SFTAdapter

        return TRLAdapter(SFTAdapter(trainer, model, tokenizer))
    if kind == "trl":
        return detection_only(trainer, f"{type(trainer).__name__}'s loss is not rebuilt (GRPOTrainer's and "
                                       "SFTTrainer's are)")
    return None
