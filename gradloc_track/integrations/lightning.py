"""Lightning callback: ``L.Trainer(..., callbacks=[GradLocCallback(clip="adagc")])``.

Each micro-batch is captured in ``on_train_batch_start`` (a dict with ``input_ids`` [``labels``,
``attention_mask``], an ``(input_ids, labels)`` tuple, or a tensor of ids); the monitor runs in
``on_before_optimizer_step`` (after the step's last backward, before Lightning's own gradient
clipping and ``optimizer.step()``). A spike's per-term loss is rebuilt by calling the
LightningModule the way an HF model is called: ``pl_module(input_ids=..., attention_mask=...)``
(or ``pl_module(input_ids)`` for a tuple/tensor batch) must return logits (B, T, V) or an output
with ``.logits``; for anything else use ``handle.set_loss_fn`` in ``training_step``. Logs through
the Trainer's ``MLFlowLogger`` (its ``run_id``) / ``WandbLogger`` (its ``experiment``), at
``trainer.global_step``; the loggers' runs stay theirs to end. The clipper's skip guard goes on the
Trainer's optimizer and runs Lightning's closure itself, so a non-finite step is skipped exactly.
"""
from __future__ import annotations

from typing import Any

from .._optional import require
from ..trackers.interface import NullTracker
from .batches import BatchList, LMBatch
from .options import resolve_options

L = require("lightning.pytorch", "lightning")

LIGHTNING_WANDB_STEP = "trainer/global_step"  # the step metric WandbLogger defines


def logger_tracker(trainer: Any, cfg: Any, run_dir: Any = None) -> Any:
    """A tracker into the runs of the Trainer's MLflow / W&B loggers, or None when it has neither."""
    from ..trackers.fanout import as_one_tracker
    from ..trackers.run_lock import RunOwner
    from .runs import mlflow_run_tracker, wandb_run_tracker

    trackers = []
    owner = RunOwner()  # both loggers' runs are one run of ours: their writers share run_dir
    for lg in getattr(trainer, "loggers", None) or []:
        kind = type(lg).__name__
        if kind == "MLFlowLogger":
            client = lg.experiment  # creates the logger's run if it is not there yet
            trackers.append(mlflow_run_tracker(lg.run_id, client.tracking_uri, cfg, run_dir, owner))
        elif kind == "WandbLogger":
            trackers.append(wandb_run_tracker(lg.experiment, LIGHTNING_WANDB_STEP, cfg, run_dir, owner))
    return as_one_tracker(trackers)


class GradLocCallback(L.Callback):
    """Gradient norms, clipping, spike detection and token localization inside Lightning.

    ``options``: as ``gradloc_track.watch``. Default tracker: the Trainer's MLflow/W&B loggers'
    runs, else a run already open, else what ``tracker=`` names. ``handle`` is the ``WatchHandle``.
    """

    def __init__(self, cfg: Any = None, **options: Any) -> None:
        self.options = resolve_options(cfg, **options)  # bad options fail here, not mid-training
        self.handle = None

    def on_fit_start(self, trainer, pl_module) -> None:
        from .runs import ScratchDir
        from .watch import WatchHandle, build_tracker

        if self.handle is not None and not self.handle.finished:
            return
        opts = self.options
        scratch = ScratchDir()  # the joined run's files when no run_dir is given; removed at finish
        run_dir = opts.run_dir if opts.run_dir is not None else scratch.path
        # only global rank 0 logs: other ranks' loggers hold dummy experiments (no run id)
        tracker = NullTracker() if getattr(trainer, "global_rank", 0) != 0 else (
            logger_tracker(trainer, opts.tracker, run_dir) if opts.tracker_auto else None)
        owns = True
        if tracker is None:
            tracker, owns = build_tracker(opts, scratch=scratch)
        optimizer = trainer.optimizers[0] if trainer.optimizers else None
        self.handle = WatchHandle(pl_module, optimizer, opts, tracker=tracker, owns_tracker=owns, capture=False,
                                  step_hook=False, scratch=scratch)
        self.handle.capture = BatchList()  # filled by on_train_batch_start

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.handle is not None:
            self.handle.capture.add(LMBatch.from_batch(batch))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.handle is not None:
            self.handle.step(trainer.global_step)

    def on_fit_end(self, trainer, pl_module) -> None:
        if self.handle is not None:
            self.handle.finish()

    def on_exception(self, trainer, pl_module, exception) -> None:
        from ..trackers.interface import exit_status

        if self.handle is not None:
            self.handle.finish(exit_status(type(exception)))  # Ctrl-C (KeyboardInterrupt): "killed"
