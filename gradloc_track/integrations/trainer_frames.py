"""The ``transformers.Trainer`` a callback belongs to, from the caller frames (no TRL, no trainer argument).

A ``TrainerCallback`` is never handed its trainer; what only the trainer has (TRL's batch, the DDP-wrapped
model Trainer trains through) is found by walking up from the callback's hook: it runs inside
``Trainer._inner_training_loop``, and the ``Trainer`` whose callback handler holds this very callback (checked
by identity, so a trainer running inside another trainer's callback is never mistaken) is the one.
"""
from __future__ import annotations

import inspect
from typing import Any

MAX_FRAMES = 64  # Trainer.train -> _inner_training_loop -> CallbackHandler.call_event -> us: a few frames


def find_trainer(callback: Any) -> Any | None:
    """The ``transformers.Trainer`` whose callbacks include ``callback``, from the caller frames."""
    frame = inspect.currentframe()
    try:
        for _ in range(MAX_FRAMES):
            frame = frame.f_back if frame is not None else None
            if frame is None:
                return None
            obj = frame.f_locals.get("self")
            handler = getattr(obj, "callback_handler", None)
            if handler is not None and any(cb is callback for cb in getattr(handler, "callbacks", ())):
                return obj
        return None
    finally:
        del frame  # frames reference their locals: do not keep the cycle alive
