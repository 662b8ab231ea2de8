"""``transformers.Trainer`` callback: ``Trainer(..., callbacks=[GradLocCallback(clip="adagc")])``.

Runs the monitor in ``on_pre_optimizer_step`` (after the step's last backward, before
``optimizer.step()``, so a clipper's in-place clipping is what the step uses), with the step's
micro-batches captured from the model's forward calls (gradient accumulation included). Logs
into the run Trainer's ``report_to`` opened (MLflow's active run, ``wandb.run``) at Trainer's
``global_step`` (the step number Trainer logs this update's ``loss`` and ``grad_norm`` under) and
never ends it. Trainer's own ``max_grad_norm`` clipping runs BEFORE this hook: we say so once.
The clipper's skip guard goes on Trainer's optimizer (its default fused AdamW skips a non-finite
step through ``found_inf``: no sync, no memory).
"""
from __future__ import annotations

import warnings
from typing import Any

from .._optional import require
from .options import resolve_options

require("transformers", "hf")
from transformers import TrainerCallback  # noqa: E402

HF_WANDB_STEP = "train/global_step"  # the step metric Trainer's WandbCallback defines


class GradLocCallback(TrainerCallback):
    """Gradient norms, clipping, spike detection and token localization inside ``Trainer``.

    ``options``: as ``gradloc_track.watch`` (``clip=``, ``spikes=``, ``locate=``, ``log_every=``,
    ``tracker=``, ``tokenizer=``, ``cfg=``...). Default tracker: the run Trainer reports to;
    the tokenizer defaults to Trainer's ``processing_class``. ``handle`` is the ``WatchHandle``.
    """

    def __init__(self, cfg: Any = None, **options: Any) -> None:
        self.options = resolve_options(cfg, **options)  # bad options fail here, not mid-training
        self.handle = None
        self._warned_clip = False

    def on_train_begin(self, args, state, control, model=None, optimizer=None, processing_class=None, **kwargs):
        from .watch import WatchHandle, build_tracker

        if args.max_grad_norm and args.max_grad_norm > 0 and not self._warned_clip:
            self._warned_clip = True
            warnings.warn(
                f"gradloc-track: Trainer clips gradients itself (max_grad_norm={args.max_grad_norm}) before "
                "GradLocCallback sees them, so grad_norm/* are post-clip norms and spikes look flattened. "
                "To hand clipping to AdaGC, pass TrainingArguments(max_grad_norm=0) and "
                "GradLocCallback(clip='adagc').", UserWarning, stacklevel=2)
        if self.handle is not None and not self.handle.finished:
            return
        opts = self.options
        if opts.tokenizer is None and processing_class is not None and hasattr(processing_class, "decode"):
            opts.tokenizer = processing_class
        tracker, owns = build_tracker(opts, wandb_step_key=HF_WANDB_STEP)  # joins report_to's run
        self.handle = WatchHandle(model, optimizer, opts, tracker=tracker, owns_tracker=owns, step_hook=False)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.handle is not None:
            # Trainer increments global_step after optimizer.step(); it logs this update at +1
            self.handle.step(state.global_step + 1)

    def on_step_end(self, args, state, control, **kwargs):
        # the report_to callbacks run first at train end (MLflow ends its run there): flush before
        if self.handle is not None and (control.should_training_stop or state.global_step >= state.max_steps):
            self.handle.flush()

    def on_train_end(self, args, state, control, **kwargs):
        if self.handle is not None:
            self.handle.remove()
            self.handle.finish()
