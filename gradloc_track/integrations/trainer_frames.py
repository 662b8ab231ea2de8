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


def tokens_averaged_scale(trainer: Any) -> float:
    """The factor ``transformers.Trainer`` multiplies a loss normalised by ``num_items_in_batch`` with when it
    averages tokens across devices (``average_tokens_across_devices``, its default):
    the count is over every process, and DDP's mean over them would shrink the gradient, so the loss is made
    ``x processes`` (``/ tp`` for tensor-parallel ranks). 1 otherwise. A rebuilt loss normalised by the same
    count needs the same factor: without it every probe under DDP was 1/world of the step (held-out tester, stop
    55: culprit norms half the one-process run's). Under DataParallel (``n_gpu > 1``) each replica's loss is
    ``x n_gpu`` and their mean is taken: 1 on the step, and on the probes (the bare model, the whole batch).
    Trainer multiplies only a loss the model computed with ``num_items_in_batch`` (``model_accepts_loss_kwargs``)
    or ``compute_loss_func``; callers apply this factor only to a normaliser read from the model's call."""
    args = getattr(trainer, "args", None)
    if args is None or not getattr(args, "average_tokens_across_devices", False) or getattr(args, "n_gpu", 1) > 1:
        return 1.0
    tp = getattr(trainer, "get_tp_size", lambda: 1)()
    return float(max(1, int(getattr(getattr(trainer, "accelerator", None), "num_processes", 1)) // max(1, int(tp))))
