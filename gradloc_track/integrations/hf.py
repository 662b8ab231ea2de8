"""``transformers.Trainer`` callback: ``Trainer(..., callbacks=[GradLocCallback(clip="adagc")])``.

Runs the monitor in ``on_pre_optimizer_step`` (after the step's last backward, before
``optimizer.step()``, so a clipper's in-place clipping is what the step uses), with the step's
micro-batches captured from the model's forward calls (gradient accumulation included). Logs
into the run Trainer's ``report_to`` opened (MLflow's active run, ``wandb.run``) at Trainer's
``global_step`` (the step number Trainer logs this update's ``loss`` and ``grad_norm`` under) and
never ends it.

Trainer clips to ``max_grad_norm`` (1.0 by default) BEFORE this hook, which would hide every
spike. The callback takes that clipping over: Trainer skips its own (``max_grad_norm`` reads 0
during ``train()``; Trainer still computes and logs the pre-clip ``grad_norm``), the monitor sees
the pre-clip gradient, then clips it to the same ``max_grad_norm`` exactly as Trainer would
(``clip_grad_norm_``'s formula), or with the configured clipper if one is (``clip="adagc"``).
Said once. Under DeepSpeed or FSDP Trainer's clipping is left alone. ``keep_columns`` and
``with_index`` (``hf_columns``) carry a dataset index and metadata to the culprit table.
Inside TRL's ``GRPOTrainer`` / ``SFTTrainer`` the same class rebuilds the loss TRL computes from the
batch TRL built, instead of the causal-LM cross-entropy (``integrations/trl``, docs/trl.md).
The clipper's skip guard goes on Trainer's optimizer (its default fused AdamW skips a non-finite
step through ``found_inf``: no sync, no memory). Every spike prints its block on rank 0's stderr
(``gradloc_track.console``; why it is not localized when it is not). A run nobody named
(``run_name`` unset) is named ``<model type> seed=<seed> <time>`` for Trainer's MLflow/W&B run,
and ``run_name`` reads unset again after ``train()``. Each checkpoint folder gets the clipper's and
detector's state (``gradloc_track.pt``), and ``train(resume_from_checkpoint=...)`` reads it back.
"""
from __future__ import annotations

import dataclasses
import os
import sys
import warnings
from typing import Any

from .._optional import require
from ..console import TrainConsole
from .options import resolve_options
from .trainer_frames import find_trainer, tokens_averaged_scale

require("transformers", "hf")
from transformers import TrainerCallback  # noqa: E402

from .hf_columns import keep_columns, with_index  # noqa: E402

__all__ = ["GradLocCallback", "keep_columns", "with_index"]

HF_WANDB_STEP = "train/global_step"  # the step metric Trainer's WandbCallback defines


class GradLocCallback(TrainerCallback):
    """Gradient norms, clipping, spike detection and token localization inside ``Trainer``.

    ``options``: as ``gradloc_track.watch`` (``clip=``, ``spikes=``, ``locate=``, ``log_every=``,
    ``tracker=``, ``tokenizer=``, ``cfg=``...). Default tracker: the run Trainer reports to;
    the tokenizer defaults to Trainer's ``processing_class``. ``handle`` is the ``WatchHandle``.
    """

    def __init__(self, cfg: Any = None, **options: Any) -> None:
        self.options = resolve_options(cfg, **options)  # bad options fail here, not mid-training
        self._spikes_given = (cfg, options.get("spikes"))  # which spikes fields the user set (RL defaults)
        self.handle = None
        self.adapter = None  # TRL trainers: records the batches TRL builds (integrations/trl)
        self._warned_clip = False
        self._trainer_max_norm: float | None = None  # Trainer's max_grad_norm while we hold its clipping
        self.console = TrainConsole(stream="stderr", rich=False)  # one block per spike (gradloc_track.console)
        self._named_run: str | None = None  # the run_name we gave TrainingArguments (none was set)

    def on_init_end(self, args, state, control, model=None, **kwargs):
        if getattr(args, "run_name", None) is None and model is not None:
            # nobody named the run: MLflow and W&B would call it "overjoyed-slug-911", like every other one
            args.run_name = self._named_run = default_run_name(model, args.seed)

    def on_train_begin(self, args, state, control, model=None, optimizer=None, processing_class=None, **kwargs):
        from .batches import MicroBatchCapture
        from .handle import Door, open_handle

        self._take_over_clipping(args)
        if self.handle is not None and not self.handle.finished:  # a train() that raised, called again
            self._resume(args, state)
            return
        opts = self.options
        if opts.tokenizer is None and processing_class is not None and hasattr(processing_class, "decode"):
            opts.tokenizer = processing_class
        if self._trainer_max_norm is not None and opts.clip.kind == "none":  # Trainer's clipping, applied by us
            from ..config import GlobalClipConfig

            opts = dataclasses.replace(opts, clip=GlobalClipConfig(max_norm=self._trainer_max_norm))
        trainer, kind = _trl_trainer(self)  # TRL's GRPO/SFT trainers: the loss they compute, not cross-entropy
        if kind == "grpo":  # RL-aware detector defaults where the user left them (integrations/rl_defaults.py)
            from .rl_defaults import given_spike_fields, rl_spikes

            given = given_spike_fields(*self._spikes_given)
            opts = dataclasses.replace(opts, spikes=rl_spikes(opts.spikes, given))
        door = Door("GradLocCallback (TRL)" if kind is not None else "GradLocCallback", hook_optimizer=False,
                    wandb_step_key=HF_WANDB_STEP)  # joins report_to's run; Trainer calls step() through us
        capture = None
        if kind is None:  # under DDP the probes must run the model Trainer trains through (its gradient all-reduce)
            model, compiled = _wrapped(self, model)
            capture = MicroBatchCapture(model, caller=compiled)
            capture.items_scale = tokens_averaged_scale(find_trainer(self))  # its loss x processes under DDP
        self.handle = open_handle(model, optimizer, opts, door, capture)
        self._resume(args, state)
        if kind is not None and self.handle.reads_batches:
            from .trl.adapters import make_adapter

            self.adapter = make_adapter(trainer, kind, model, self.handle.tokenizer)

    def _resume(self, args, state) -> None:
        """Resumed from a checkpoint (``global_step`` > 0 at the start): the clipper's and detector's state
        ``on_save`` wrote into it."""
        if state.global_step > 0:
            from .checkpoint_state import load_state

            load_state(self.handle, _resumed_folder(args, state, self), state.global_step)

    def _take_over_clipping(self, args) -> None:
        """Trainer skips its ``max_grad_norm`` clipping during ``train()``; the monitor clips after it
        has seen the pre-clip gradient (DeepSpeed and FSDP clip inside their engines: left alone)."""
        norm = args.max_grad_norm
        if not norm or norm <= 0:
            return
        engine = getattr(args, "deepspeed", None) or getattr(args, "fsdp", None)
        if engine:
            self._say_once(f"gradloc-track: Trainer clips gradients itself (max_grad_norm={norm}) under DeepSpeed/"
                           "FSDP before GradLocCallback sees them, so grad_norm/* are post-clip norms and spikes "
                           "look flattened. To hand clipping to AdaGC, pass TrainingArguments(max_grad_norm=0) and "
                           "GradLocCallback(clip='adagc').")
            return
        self._trainer_max_norm, args.max_grad_norm = float(norm), 0.0
        kind = self.options.clip.kind
        then = (f"clips it to {norm} exactly as Trainer would (clip/total_norm_pre, clip/total_norm_post)"
                if kind == "none" else f"clips it with the configured clipper (clip={kind!r}) instead")
        self._say_once(f"gradloc-track: GradLocCallback takes over Trainer's gradient clipping (max_grad_norm={norm}):"
                       " Trainer skips its own, the callback sees the pre-clip gradient (Trainer still logs it as "
                       f"grad_norm), then {then}.")

    def _say_once(self, message: str) -> None:
        if not self._warned_clip:
            self._warned_clip = True
            warnings.warn(message, UserWarning, stacklevel=3)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.handle is not None:
            ctx = self.adapter.context() if self.adapter is not None else None
            # Trainer increments global_step after optimizer.step(); it logs this update at +1
            # under fp16 Trainer's GradScaler skips an overflowed step itself: routine, not a spike
            stats = self.handle.step(state.global_step + 1, spike_context=ctx, loss_scaler=bool(args.fp16))
            # the spike block: culprits, or why not localized (console=False: none)
            if stats.events and state.is_world_process_zero and self.handle.options.console:
                why = self.adapter.why_not() if self.adapter is not None else None
                self.console.spike(stats, self.handle.run_dir, not_localized=why)

    def on_save(self, args, state, control, **kwargs):
        # Trainer has written checkpoint-<global_step>: the clipper's and detector's state goes beside it
        if self.handle is not None and args.should_save:  # rank 0, or each node's first with save_on_each_node
            from .checkpoint_state import save_state

            save_state(self.handle, _checkpoint_folder(args, state, find_trainer(self)))

    def on_step_end(self, args, state, control, **kwargs):
        # the report_to callbacks run first at train end (MLflow ends its run there): flush before
        if self.handle is not None and (control.should_training_stop or state.global_step >= state.max_steps):
            self.handle.flush()

    def on_train_end(self, args, state, control, **kwargs):
        if self._trainer_max_norm is not None:  # the user's TrainingArguments read as they wrote them again
            args.max_grad_norm, self._trainer_max_norm = self._trainer_max_norm, None
        if self._named_run is not None and args.run_name == self._named_run:
            args.run_name, self._named_run = None, None
        if self.adapter is not None:
            self.adapter.remove()
            self.adapter = None
        if self.handle is not None:
            self.handle.close()  # every hook off; Trainer's run stays open for its owner


def default_run_name(model: Any, seed: int) -> str:
    """``gpt2 seed=0 11-25 17:36:05``: the model's config, the seed and the start time, so runs of the
    same script tell apart in the experiment's chart view."""
    import time

    kind = getattr(getattr(model, "config", None), "model_type", None) or type(model).__name__
    return f"{kind} seed={seed} {time.strftime('%m-%d %H:%M:%S')}"


def _checkpoint_folder(args: Any, state: Any, trainer: Any = None) -> str:
    """The folder Trainer saves the checkpoint of ``state.global_step`` in: under a hyperparameter search's trial
    folder (``run-<trial>/``) when ``trainer`` runs one (the state went to ``output_dir`` and the trial's own
    checkpoint resumed without it), else under ``output_dir``."""
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    base = args.output_dir
    if trainer is not None and getattr(trainer, "hp_search_backend", None) is not None:
        try:
            base = trainer._get_output_dir(trial=getattr(trainer, "_trial", None))
        except Exception:  # Trainer's private helper changed: output_dir, as before
            pass
    return os.path.join(base, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")


def _resumed_folder(args: Any, state: Any, callback: Any = None) -> str:
    """The checkpoint ``train()`` resumes from. Trainer does not tell callbacks; its training loop holds the path
    (``resume_from_checkpoint``, already resolved from ``True``) a few frames up the stack from this callback.
    Else the folder Trainer would have saved this step's checkpoint in."""
    frame = sys._getframe(1)
    for _ in range(_FRAMES):
        if frame is None:
            break
        if frame.f_code.co_name == "_inner_training_loop":
            path = frame.f_locals.get("resume_from_checkpoint")
            if isinstance(path, (str, os.PathLike)):
                return os.fspath(path)
            break
        frame = frame.f_back
    return _checkpoint_folder(args, state, find_trainer(callback) if callback is not None else None)


_FRAMES = 16  # how far up the stack the training loop is looked for (on_train_begin is ~4 frames below it)


def _wrapped(callback: GradLocCallback, model: Any) -> tuple[Any, Any]:
    """(the model to probe, Trainer's compiled wrapper around it or None). The first is Trainer's ``model_wrapped``
    when that is DDP around ``model`` (``torchrun``): callbacks get the bare model, whose probes never all-reduce
    their gradients, so every localization under DDP failed its step check ('the gradient differs across ranks',
    held-out tester round 8); else ``model`` (one process, DeepSpeed, FSDP). The second is the
    ``torch.compile`` wrapper ``torch_compile=True`` puts around either: the forwards run inside it, traced, where
    hooks on the model record nothing (held-out tester, stop 57: no spike was localized)."""
    from torch.nn.parallel import DistributedDataParallel

    wrapped = getattr(find_trainer(callback), "model_wrapped", None)
    compiled = wrapped if type(wrapped).__name__ == "OptimizedModule" else None
    inner = getattr(compiled, "_orig_mod", wrapped)
    if isinstance(inner, DistributedDataParallel) and inner.module is model:
        return inner, compiled
    return model, compiled if inner is model else None


def _trl_trainer(callback: GradLocCallback) -> tuple[Any, str | None]:
    """(TRL trainer, its kind) when this callback runs inside one (TRL already imported), else (None, None)."""
    if "trl" not in sys.modules:  # a TRL trainer means TRL is imported: never import it to look
        return None, None
    from .trl.adapters import detect

    return detect(callback)
