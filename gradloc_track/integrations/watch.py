"""``gradloc_track.watch(model, optimizer)``: everything on, in one call, with no other change.

```python
handle = gradloc_track.watch(model, optimizer, clip="adagc")  # joins wandb.run / mlflow.active_run()
for batch in data:
    model(**batch).loss.backward()   # HF-style call: the micro-batch is captured for localization
    optimizer.step()                 # the step pre-hook runs norms, clipping, detection, localization
    optimizer.zero_grad()
handle.finish()                      # flushes; leaves a run it did not open open
```

The handle is a thin adapter over ``GradMonitor``: it builds what the Hydra app builds
(tracker, clipper, detector, artifact writer, monitor) from Hydra-named options, installs an
optimizer step pre-hook (so ``step()`` uses the clipped gradient) and a forward pre-hook that
captures the step's token ids, and rebuilds the per-term loss on a spike.

A wrapped optimizer (Accelerate's ``AcceleratedOptimizer``, whose ``step()`` runs the real one
only when ``accelerator.sync_gradients``) is hooked on the optimizer inside it, so the hook fires
once per real step under ``accelerator.accumulate``. A run joined without ``run_dir`` keeps its
files in a temporary directory that ``finish()`` removes (kept, and named, only if records the
backend did not take are spooled there for ``gradloc-track replay``).
The clipper's skip guard goes on the optimizer: a non-finite step leaves weights and optimizer
state bitwise unchanged (``clip.skip_step``). The spike context is built only when a spike fires.
"""
from __future__ import annotations

import functools
import logging
import sys
import warnings
from typing import Any, Callable

import torch

from .batches import MicroBatchCapture, lm_spike_context, resolve_tokenizer
from .step_losses import step_loss, step_sample_losses
from .calls import SET_LOSS_FN_HINT
from .options import WatchOptions, resolve_options
from .runs import ScratchDir
from ..trackers.interface import Tracker

__all__ = ["watch", "WatchHandle"]
log = logging.getLogger(__name__)


def hookable_optimizer(optimizer: Any) -> Any:
    """The torch optimizer whose ``step()`` really runs: a wrapper without torch's hook tables
    (Accelerate's ``AcceleratedOptimizer``, which skips the inner step on accumulation micro-steps)
    is unwrapped through its ``optimizer`` attribute."""
    seen = 0
    while optimizer is not None and not hasattr(optimizer, "_optimizer_step_pre_hooks") and seen < 4:
        inner = getattr(optimizer, "optimizer", None)
        if inner is None or inner is optimizer:
            break
        optimizer, seen = inner, seen + 1
    return optimizer


def say_where(backend: Tracker) -> None:
    """Once per run ``watch()`` opened itself: where it went (the user did not name a place)."""
    where = getattr(backend, "where", None)
    if callable(where):
        print(f"gradloc-track: watch() opened {where()}", file=sys.stderr, flush=True)


def build_tracker(opts: WatchOptions, wandb_step_key: str | None = None,
                  scratch: ScratchDir | None = None) -> tuple[Tracker, bool]:
    """(tracker, whether we own its run): an explicit tracker/config, else the open run, else a new
    one from the default ``TrackerConfig`` (as the app builds it). A joined run's files go to
    ``opts.run_dir``, else to ``scratch`` (removed at ``finish()``). ``wandb_step_key``: the step
    metric of the framework whose W&B run is joined (``None``: the user's own run)."""
    import torch.distributed as dist

    from ..trackers import NullTracker, make_tracker

    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return NullTracker(), True  # only rank 0 logs (the monitor's rule): no run per rank
    if isinstance(opts.tracker, Tracker):
        return opts.tracker, False  # the caller's object: the caller finishes it
    if opts.tracker_auto:
        from .runs import open_run_tracker

        run_dir = opts.run_dir if opts.run_dir is not None or scratch is None else scratch.path
        joined = open_run_tracker(opts.tracker, run_dir, wandb_step_key)
        if joined is not None:
            return joined, True  # ours to flush; the adapters leave the run itself open
        if opts.tracker.kind == "none" and opts.run_dir is None:
            log.info("gradloc-track: no open W&B/MLflow run and tracker='none': metrics stay in handle.last; "
                     "pass tracker='mlflow'|'wandb' or open a run first")
    return make_tracker(opts.tracker, run_dir=opts.run_dir, run_name=opts.run_name, on_open=say_where), True


def _quarantine(tracker: Tracker) -> Any:
    from ..data.quarantine import logging_quarantine

    return logging_quarantine(tracker)


class WatchHandle:
    """What ``watch()`` returns. ``step()`` runs the monitor on the current gradients (called for
    you by the optimizer hook); ``last`` is the last ``GradStats``, ``spikes`` those of the steps
    where a spike fired; ``finish()`` flushes (and ends a run only if ``watch`` opened it);
    ``remove()`` takes every hook off. A context manager (exit = ``remove()`` + ``finish()``).
    A ``Tracker`` object passed as ``tracker=`` stays the caller's to finish. With
    ``spikes={"quarantine": True}``, ``quarantine`` holds this run's culprit samples: the data path
    asks ``handle.quarantine.admit(fingerprint, step)`` (each skip is warned and logged)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, opts: WatchOptions, *,
                 tracker: Tracker | None = None, owns_tracker: bool = True, capture: bool = True,
                 step_hook: bool = True, scratch: ScratchDir | None = None) -> None:
        from ..artifacts import SpikeArtifactWriter
        from ..clip import build_clipper
        from ..monitor import GradMonitor
        from ..spikes import SpikeDetector

        optimizer = hookable_optimizer(optimizer)
        self.model, self.optimizer, self.options = model, optimizer, opts
        self.scratch = scratch if scratch is not None else ScratchDir()  # a joined run's files; gone at finish
        self._hooks = []
        if optimizer is not None and step_hook:
            if not hasattr(optimizer, "register_step_pre_hook"):
                raise TypeError(f"gradloc-track: cannot hook {type(optimizer).__name__}.step(): pass the torch "
                                "optimizer it wraps, or no optimizer and call handle.step() after backward()")
            # registered BEFORE the monitor installs its skip guard: the guard's step hooks must see
            # this step's clip (a sync-mode guard reads the flag in its own pre-hook)
            self._hooks.append(optimizer.register_step_pre_hook(self._pre_step))
        try:
            if tracker is None:
                tracker, owns_tracker = build_tracker(opts, scratch=self.scratch)
            self.tracker, self._owns_tracker = tracker, owns_tracker
            self.tokenizer = resolve_tokenizer(model, opts.tokenizer)
            detector = SpikeDetector(opts.spikes) if opts.spikes.enabled else None
            writer = SpikeArtifactWriter(tracker, run_dir=opts.run_dir, top_layers=opts.locate.top_layers)
            self.monitor = GradMonitor(model, tracker=tracker, clipper=build_clipper(opts.clip, model),
                                       config=opts.monitor, optimizer=optimizer, detector=detector,
                                       locate_config=opts.locate, artifact_writer=writer)
        except BaseException:
            for h in self._hooks:
                h.remove()
            raise
        self.capture = MicroBatchCapture(model) if capture else None
        if self.capture is not None:  # the detector's largest-sample signal, measured from the captured forward
            self.capture.sample_losses = "sample_losses" in self.monitor.detector_inputs.wants
        # spikes.quarantine: this run's culprit samples, for the data path to skip (docs/ledger.md)
        self.quarantine = _quarantine(self.tracker) if getattr(opts.spikes, "quarantine", False) else None
        self.last = None
        self.spikes: list = []  # GradStats of every step whose spike fired (with .locate when localized)
        self.steps = 0  # optimizer steps seen; the default step number
        self._user_ctx = None
        self._finished = False
        self._said_unusable = False

    # -- the loop's side -------------------------------------------------------------------
    def _pre_step(self, optimizer, args, kwargs) -> None:
        self.step()

    def set_loss_fn(self, loss_fn: Callable[[torch.Tensor], torch.Tensor] | list, token_mask: Any,
                    input_ids: Any = None, **context: Any) -> None:
        """Your own ``loss_fn(mask)`` for this step (RL objectives, custom losses): used instead of the
        captured batches by the next ``step()``. Lists = one entry per micro-batch. ``context``:
        other ``SpikeContext`` fields (``extra_columns``, ``sample_columns``, ``rng_state``)."""
        from ..spikes.context import SpikeContext

        self._user_ctx = SpikeContext(loss_fn=loss_fn, token_mask=token_mask, input_ids=input_ids,
                                      tokenizer=context.pop("tokenizer", self.tokenizer), **context)

    def set_sample_info(self, **columns: Any) -> None:
        """Per-sample columns for the culprit table, for one micro-batch: ``dataset_index=idx,
        source=["web", ...]`` (each B values: a 1-D tensor or a list). Call it once per micro-batch,
        before or after its forward; the step pairs the calls with its micro-batches in order.
        (``set_loss_fn`` takes ``sample_columns=`` instead.)"""
        if self.capture is None:
            raise RuntimeError("gradloc-track: set_sample_info needs the batch capture; with your own loss pass "
                               "sample_columns= to set_loss_fn")
        self.capture.add_info(columns)

    def step(self, step: int | None = None, *, lr: float | None = None, spike_context: Any = None):
        """Monitor (and clip) the gradients now, after ``backward()`` and before ``optimizer.step()``."""
        if self._finished:
            raise RuntimeError("gradloc-track: this watch() handle is finished; call watch() again for a new run")
        step = self.steps if step is None else int(step)
        ctx = spike_context or self._user_ctx
        batches, rng = self.capture.take() if self.capture is not None else ([], None)
        if ctx is None and batches and self.monitor.detector is not None and self._rebuildable(batches):
            # built only if a spike fires: no per-step tensor work for the no-spike steps
            ctx = functools.partial(lm_spike_context, self.model, batches, self.tokenizer, rng_state=rng)
        self._user_ctx = None
        with self._paused():
            self.last = self.monitor.after_backward(step, lr=lr, spike_context=ctx, loss=step_loss(batches),
                                                    sample_losses=step_sample_losses(batches))
        if self.last.events:
            self.spikes.append(self.last)
            if self.quarantine is not None and self.last.locate_view:  # rank 0's view under torch.distributed
                self.quarantine.blame(step, *self.last.locate_view)
        self.steps += 1
        return self.last

    def _rebuildable(self, batches: list) -> bool:
        """Can the per-term loss be rebuilt from the captured calls? If not, say why once (naming
        ``set_loss_fn``): spikes are still detected, not localized."""
        why = next((b.unusable for b in batches if b.unusable), None)
        if why is not None and not self._said_unusable:
            self._said_unusable = True
            warnings.warn(f"gradloc-track: {why}; spikes are detected but not localized. To localize them, "
                          f"{SET_LOSS_FN_HINT}", UserWarning, stacklevel=4)
        return why is None

    def _paused(self):
        import contextlib

        return self.capture.paused() if self.capture is not None else contextlib.nullcontext()

    # -- cleanup ---------------------------------------------------------------------------
    def remove(self) -> None:
        """Take every hook off (the optimizer's, the skip guard's and the model's); logging state is kept."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        if self.monitor.skip_guard is not None:
            self.monitor.skip_guard.remove()
        if self.capture is not None:
            self.capture.remove()

    @property
    def finished(self) -> bool:
        return self._finished

    def flush(self) -> None:
        self.tracker.flush()

    def finish(self, status: str = "success") -> None:
        """Write everything out. A run ``watch`` opened is ended with ``status``; a run it joined
        (``wandb.run``, ``mlflow.active_run()``, a framework's) stays open for its owner."""
        if self._finished:
            return
        self._finished = True
        if self._owns_tracker:
            try:
                self.tracker.finish(status)
            except Exception as exc:  # never kill training for logging
                warnings.warn(f"gradloc-track: finishing the tracker failed: {exc!r}")
        else:
            self.tracker.flush()
        self.scratch.remove()  # a joined run's temporary files (kept if the spool still holds records)

    def __enter__(self) -> "WatchHandle":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        from ..trackers.interface import exit_status

        self.remove()
        self.finish(exit_status(exc_type))  # Ctrl-C: "killed"


def watch(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, *, cfg: Any = None,
          **options: Any) -> WatchHandle:
    """Turn on norms, clipping, spike detection and localization for ``model``.

    ``options`` are the Hydra config's names: ``tracker`` ("mlflow", "wandb", "both", "none", a
    ``Tracker``; default: the run already open, ``wandb.run`` / ``mlflow.active_run()``), ``clip``
    ("adagc", "zclip", ..., ``{"kind": "adagc", "beta": 0.98}`` or a schema such as
    ``AdaGCConfig``), ``spikes``, ``locate``, ``monitor`` and the monitor's fields
    (``log_every=10``), or ``cfg=`` a Hydra node holding those groups; plus
    ``tokenizer`` (decoded culprit text), ``run_dir``, ``run_name``. Bad values raise the errors the
    Hydra app raises. With ``optimizer`` an optimizer step pre-hook runs everything; without it,
    call ``handle.step()`` after ``backward()``.
    """
    return WatchHandle(model, optimizer, resolve_options(cfg, **options))
