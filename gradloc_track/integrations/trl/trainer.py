"""Find the TRL trainer a callback belongs to, and wrap its methods for the run's duration.

A ``TrainerCallback`` is never handed its trainer, and TRL's losses need what only the trainer
has (the batch it built: advantages, old log-probs, packed position ids). The callback's
``on_train_begin`` runs inside ``Trainer._inner_training_loop``; walking up the caller frames
finds the ``Trainer`` whose callback handler holds this callback (checked by identity, so a
trainer running inside another trainer's callback is never mistaken). The wrappers are
instance attributes over the bound methods (``trainer.compute_loss = wrapped``), which
``training_step`` looks up on each call; ``remove()`` deletes them, leaving the class untouched.
"""
from __future__ import annotations

from typing import Any, Callable

from ..trainer_frames import find_trainer  # noqa: F401 (the adapters' and tests' name for it)


def trl_kind(trainer: Any) -> str | None:
    """"grpo" / "sft" when ``trainer`` is (a subclass of) TRL's GRPOTrainer / SFTTrainer; else None.

    By class name and module along the MRO, so nothing imports ``trl`` to ask."""
    for cls in type(trainer).__mro__:
        if not cls.__module__.startswith("trl."):
            continue
        if cls.__name__ == "GRPOTrainer":
            return "grpo"
        if cls.__name__ == "SFTTrainer":
            return "sft"
    return None


# the methods whose result is the loss we rebuild, per trainer kind: a subclass that defines one of
# them computes a loss of its own (TRL's GMPOTrainer overrides GRPOTrainer's ``_compute_loss``)
LOSS_METHODS = {"grpo": ("compute_loss", "_compute_loss", "_get_per_token_logps_and_entropies"),
                "sft": ("compute_loss",)}
TRL_BASES = {"grpo": "GRPOTrainer", "sft": "SFTTrainer"}


def own_loss(trainer: Any, kind: str) -> str | None:
    """Why ``trainer``'s loss is not the one TRL's ``GRPOTrainer`` / ``SFTTrainer`` computes, when a
    subclass (TRL's own or the user's) overrides a method that computes it; else None."""
    base = TRL_BASES[kind]
    for cls in type(trainer).__mro__:
        if cls.__name__ == base and cls.__module__.startswith("trl."):
            return None
        found = [m for m in LOSS_METHODS[kind] if m in vars(cls)]
        if found:
            return (f"{cls.__name__} overrides {base}.{', '.join(found)}: its loss is its own, and only {base}'s "
                    "is rebuilt")
    return None


def is_trl(trainer: Any) -> bool:
    return any(cls.__module__.startswith("trl.") for cls in type(trainer).__mro__)


class MethodPatch:
    """``trainer.<name>`` replaced by ``make(original)`` until ``remove()``."""

    def __init__(self, obj: Any, name: str, make: Callable[[Callable], Callable]) -> None:
        self.obj, self.name = obj, name
        self.had_own = name in vars(obj)  # an instance attribute someone else set: restore it
        self.previous = vars(obj).get(name)
        setattr(obj, name, make(getattr(obj, name)))

    def remove(self) -> None:
        if self.obj is None:
            return
        if self.had_own:
            setattr(self.obj, self.name, self.previous)
        else:
            vars(self.obj).pop(self.name, None)
        self.obj = None
