"""``WatchHandle``: the one handle every front door builds (``watch()``, the HF / TRL and Lightning
callbacks, verl's engine session), through ``open_handle``.

``open_handle(model, optimizer, opts, door, capture)`` asks ``trackers.join`` for the run (join
the open one, else open one: the one place that does) and builds the handle around it with the
capture object the door feeds (``batches.BatchList``: forward hooks for ``watch()`` and HF,
Lightning's ``on_train_batch_start`` for Lightning, none for TRL, whose adapter rebuilds the loss).
What differs between doors is a ``Door``: whether an optimizer step pre-hook runs ``step()``
(``watch()``) or the framework calls it (the callbacks), the W&B step metric of the framework's
run, which runs to join, whether this rank logs.

``close(status)`` (= ``finish``) is the one way out: every hook the handle installed comes off
(the optimizer pre-hook, the clipper's skip guard, the capture's forward hooks), then the run
is closed (a run we opened is ended, a joined one stays open, a scratch dir goes). A finished
handle never raises from a hook: ``watch()`` -> ``finish()`` -> ``watch()`` trains.
"""
from __future__ import annotations

import contextlib
import functools
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from ..clip.checkpoint import check_state, state_kind
from ..config import ConfigError, TrackerConfig
from ..trackers.factory import without_spike_detection
from ..console import TrainConsole
from ..optim_unwrap import unwrap_optimizer
from ..trackers.interface import Tracker
from ..trackers.join import OpenRuns, Run, RunRequest, start
from .batches import BatchList, lm_spike_context, resolve_tokenizer
from .calls import SET_LOSS_FN_HINT
from .grad_scaler import skipped_by, unscale_handed_scale, watch_scaler
from .step_losses import step_junk, step_loss, step_sample_losses
from .options import WatchOptions, option_params


def hookable_optimizer(optimizer: Any, hook: bool = False) -> Any:
    """The torch optimizer whose ``step()`` really runs (``unwrap_optimizer``: Accelerate's wrapper
    skips the inner step on accumulation micro-steps). ``hook``: a step pre-hook goes on it (a
    ``TypeError`` naming the fix when it cannot)."""
    if hook and isinstance(optimizer, (list, tuple, dict)):  # several optimizers (a tester, stop 55: a bare TypeError)
        what = f"a {type(optimizer).__name__} of {len(optimizer)}"  # (a dict of one read "not 1": stop 56)
        raise TypeError(f"gradloc-track: watch() takes one torch optimizer, not {what}: with several, pass "
                        "none (watch(model)) and call handle.step() after backward() and before the optimizers "
                        "step: the clipping then covers every parameter before any of them steps")
    optimizer = unwrap_optimizer(optimizer)
    if hook and optimizer is not None and not hasattr(optimizer, "register_step_pre_hook"):
        raise TypeError(f"gradloc-track: cannot hook {type(optimizer).__name__}.step(): pass the torch "
                        "optimizer it wraps, or no optimizer and call handle.step() after backward()")
    return optimizer


@dataclass(frozen=True)
class Door:
    """What differs between the front doors; everything else is the one handle.

    ``name``: said when the run is opened or joined. ``hook_optimizer``: an optimizer step pre-hook
    runs ``step()`` (``watch()``); a callback calls ``step()`` itself. ``wandb_step_key``: the step
    metric of the framework whose W&B run may be open (HF Trainer's); None: the user's own run.
    ``runs``: the framework's own runs to join (Lightning's loggers), else those open in this
    process. ``logs``: None: rank 0 of ``torch.distributed`` logs; a framework's rank otherwise.
    ``wrap_tracker``: wraps the run's tracker before the monitor is built (verl: the monitor's
    metrics are held for verl's own logger, the rest goes to the run). ``spike_console``: the handle
    prints the spike block itself at each detected spike (``watch()``; a callback prints its own)."""

    name: str = "watch()"
    hook_optimizer: bool = True
    wandb_step_key: str | None = None
    runs: OpenRuns | None = None
    logs: bool | None = None
    wrap_tracker: Callable[[Tracker], Tracker] | None = None
    spike_console: bool = False


def warn_if_partial(model: torch.nn.Module, optimizer: Any) -> None:
    """Say once when the optimizer ``watch()`` hooks holds only some of the model's trainable parameters (a
    tester, stop 55: with a second optimizer stepping first, its parameters trained on gradients the clipper
    had not seen yet, while the run logged them clipped)."""
    owned = {id(p) for g in getattr(optimizer, "param_groups", ()) for p in g.get("params", ())}
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not owned or owned.isdisjoint(id(p) for _, p in trainable):  # none of the model's: master weights, not part
        return
    missing = [n for n, p in trainable if id(p) not in owned]
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        warnings.warn(f"gradloc-track: the optimizer given to watch() holds none of {len(missing)} trainable "
                      f"parameter(s) of the model ({shown}): watch() runs at its step, so an optimizer that steps "
                      "before it takes unclipped gradients, and a skipped step is skipped for this one only. With "
                      "several optimizers, pass none (watch(model)) and call handle.step() after backward(), "
                      "before they step", RuntimeWarning, stacklevel=4)


def optimizer_steps_taken(optimizer: Any) -> int:
    """The steps an optimizer has taken, from the first parameter's ``step`` in its state (Adam-like; one host
    read, once a run); 0 for none or an optimizer that keeps no step count."""
    if optimizer is None:
        return 0
    state = getattr(optimizer, "state", None) or {}
    inner = getattr(optimizer, "optim", None)  # ZeroRedundancyOptimizer keeps its state in the optimizer it wraps
    if not state and inner is not None:
        return optimizer_steps_taken(inner)
    for group in getattr(optimizer, "param_groups", ()):
        for p in group.get("params", ()):
            taken = state.get(p, {}).get("step")
            if taken is not None:
                try:
                    return int(taken.item() if isinstance(taken, torch.Tensor) else taken)
                except (TypeError, ValueError, RuntimeError):
                    return 0
    return 0


def _rank0() -> bool:
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized() and dist.get_rank() != 0)


def say_where(door: str) -> Callable[[Tracker], None]:
    """Once per backend run: where it is (the run we opened, or the one we joined), with its link."""
    def say(backend: Tracker) -> None:
        where = getattr(backend, "where", None)
        if callable(where):
            verb = "joined" if getattr(backend, "attached", False) else "opened"
            print(f"gradloc-track: {door} {verb} {where()}", file=sys.stderr, flush=True)

    return say


def run_request(opts: WatchOptions, door: Door) -> RunRequest:
    """The run a door's options ask ``trackers.join`` for."""
    own = opts.tracker if isinstance(opts.tracker, Tracker) else None
    cfg = opts.tracker if own is None else TrackerConfig()
    if not opts.spikes.enabled:  # a run it opens says it looked for no spike, rather than counting 0 of them
        cfg = without_spike_detection(cfg)
    return RunRequest(cfg=cfg, run_dir=opts.run_dir,
                      run_name=opts.run_name, tracker=own, auto=opts.tracker_auto, join=door.runs,
                      wandb_step_key=door.wandb_step_key, logs=_rank0() if door.logs is None else door.logs,
                      on_open=say_where(door.name))


def open_handle(model: torch.nn.Module, optimizer: Any, opts: WatchOptions, door: Door | None = None,
                capture: BatchList | None = None) -> "WatchHandle":
    """The one way a front door builds its handle: the run through ``trackers.join``, then the
    handle around it. On failure nothing is left behind (the capture's hooks, the run)."""
    door = door or Door()
    run = None
    try:
        hookable_optimizer(optimizer, door.hook_optimizer)  # a bad optimizer fails before any run is opened
        run = start(run_request(opts, door))
        if door.wrap_tracker is not None:
            run.tracker = door.wrap_tracker(run.tracker)
        return WatchHandle(model, optimizer, opts, run, capture, hook_optimizer=door.hook_optimizer,
                           console=door.spike_console and opts.console)
    except BaseException:
        if capture is not None:
            capture.remove()
        if run is not None:
            run.close("failed")
        raise


def _quarantine(tracker: Tracker) -> Any:
    from ..data.quarantine import logging_quarantine

    return logging_quarantine(tracker)


class WatchHandle:
    """What ``watch()`` and the callbacks hold. ``step()`` runs the monitor on the current gradients
    (called for you by the optimizer hook); ``last`` is the last ``GradStats``, ``spikes`` those of
    the steps where a spike fired; ``close()`` / ``finish()`` take every hook off and end the run
    (only if it was opened here: a joined run stays open); ``remove()`` only takes the hooks off.
    A context manager (exit = ``close()``). A ``Tracker`` object passed as ``tracker=`` stays the
    caller's to finish. ``run_dir``: where the run's files are while it runs. With
    ``spikes={"quarantine": True}``, ``quarantine`` holds this run's culprit samples: the data path
    asks ``handle.quarantine.admit(fingerprint, step)`` (each skip is warned and logged).

    Built by ``open_handle`` (``run``: from ``trackers.join``; ``capture``: what feeds the step's
    batches, or None when the door brings its own loss context)."""

    def __init__(self, model: torch.nn.Module, optimizer: Any, opts: WatchOptions, run: Run,
                 capture: BatchList | None = None, *, hook_optimizer: bool = True, console: bool = False) -> None:
        optimizer = hookable_optimizer(optimizer, hook_optimizer)
        self.model, self.optimizer, self.options, self.run = model, optimizer, opts, run
        self.capture = capture
        self._hooks: list[Any] = []
        if optimizer is not None and hook_optimizer:
            warn_if_partial(model, optimizer)
            # registered BEFORE the monitor installs its skip guard: the guard's step hooks must see
            # this step's clip (a sync-mode guard reads the flag in its own pre-hook)
            self._hooks.append(optimizer.register_step_pre_hook(self._pre_step))
        try:
            self.tokenizer = resolve_tokenizer(model, opts.tokenizer)
            self.monitor = self._monitor(model, optimizer, opts)
        except BaseException:
            self._unhook()
            raise
        if run.owned and not run.joined and self.monitor.rank == 0:  # a run of ours: its settings, to compare by
            self.tracker.log_params(option_params(opts))
        if capture is not None:  # the detector's largest-sample signal, measured from the captured forward
            capture.wanted = self.reads_batches  # (``BatchList.wanted``)
            capture.sample_losses = "sample_losses" in self.monitor.detector_inputs.wants
            if "junk_span" in self.monitor.detector_inputs.wants:
                capture.junk_terms = self.monitor.detector.config.junk_terms
        # spikes.quarantine: this run's culprit samples, for the data path to skip (docs/ledger.md)
        self.quarantine = _quarantine(self.tracker) if getattr(opts.spikes, "quarantine", False) else None
        self.last = None
        self._loss_scaler = False  # this step's gradients were handed over by a GradScaler (fused optimizer)
        self._warned_traced = False  # said once: the capture's hooks were traced into a compiled caller
        self._stepped = False  # the optimizer's step ran since the scaler's last update()
        watched = opts.scaler is not None and optimizer is not None and hook_optimizer
        self._scaler = watch_scaler(opts.scaler, self) if watched else None
        self.spikes: list = []  # GradStats of every step whose spike fired (with .locate when localized)
        self.steps = 0  # optimizer steps seen; the default step number
        # watch() on an optimizer that has stepped before, with no state loaded: said once at the first step (the
        # callbacks resume from their checkpoints themselves and say when they cannot)
        self._resume_checked = not hook_optimizer
        self._user_ctx = None
        self._finished = False
        self._said_unusable = False
        self.console = TrainConsole(stream="stderr", rich=False) if console else None  # watch()'s spike block

    def _monitor(self, model: torch.nn.Module, optimizer: Any, opts: WatchOptions) -> Any:
        from ..artifacts import SpikeArtifactWriter
        from ..clip import build_clipper
        from ..monitor import GradMonitor
        from ..spikes import SpikeDetector

        detector = SpikeDetector(opts.spikes) if opts.spikes.enabled else None
        writer = SpikeArtifactWriter(self.tracker, run_dir=self.run.kept_dir, top_layers=opts.locate.top_layers)
        return GradMonitor(model, tracker=self.tracker, clipper=build_clipper(opts.clip, model), config=opts.monitor,
                           optimizer=optimizer, detector=detector, locate_config=opts.locate, artifact_writer=writer)

    @property
    def tracker(self) -> Tracker:
        return self.run.tracker

    @property
    def reads_batches(self) -> bool:
        """Does anything read the training batches? Only a spike detector does (its signals, a spike's
        localization): with ``spikes=False`` no door records them (issue 38: recording them cost the step)."""
        return self.monitor.detector is not None

    @property
    def run_dir(self) -> Path:
        """Where the run's files are while it runs: the ``run_dir`` given, else a scratch dir that
        ``close()`` removes (the run record is there meanwhile, for the console's links)."""
        return self.run.dir.path

    # -- the loop's side -------------------------------------------------------------------
    def _pre_step(self, optimizer, args, kwargs) -> None:
        if not self._finished:  # a hook of a finished handle does nothing (it is removed at close anyway)
            # a GradScaler's fused step: the monitor reads unscaled gradients, and the scaler skips an overflow
            self._loss_scaler = unscale_handed_scale(optimizer)
            self._stepped = True
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

    def step(self, step: int | None = None, *, lr: float | None = None, spike_context: Any = None,
             loss_scaler: bool = False):
        """Monitor (and clip) the gradients now, after ``backward()`` and before ``optimizer.step()``.
        ``loss_scaler``: a float16 loss scaler (``GradScaler``) skips this step itself if its gradient
        overflowed; that is logged as ``train/skipped_step``, not a spike (the hook knows it by itself)."""
        if self._finished:
            raise RuntimeError("gradloc-track: this watch() handle is finished; call watch() again for a new run")
        if not self._resume_checked:
            self._resume_checked = True
            self._say_if_resumed_without_state(numbered=step is None)
        step = self.steps if step is None else int(step)
        ctx = spike_context or self._user_ctx
        batches, rng = self.capture.take() if self.capture is not None else ([], None)
        if not batches and getattr(self.capture, "traced_step", False) and not self._warned_traced:
            self._warned_traced = True
            warnings.warn("gradloc-track: the model's forward ran inside torch.compile with watch()'s hooks traced "
                          "into its graph, where they record nothing: give watch() the compiled module "
                          "(watch(torch.compile(model), opt), or model.compile() in place) for the loss signals and "
                          "localization; the gradient norms and clipping work either way", UserWarning, stacklevel=2)
        if ctx is None and not batches and self.capture is not None:  # a spike's reason (not "no spike_context
            # passed"); a TRL door records through its adapter, no capture (review, stop 57)
            self.monitor.responder.no_context = (
                "the model's forward ran traced inside torch.compile, where watch()'s hooks record no batch"
                if self._warned_traced else "no training forward of the watched model was "
                "recorded this step")
        if ctx is None and batches and self.monitor.detector is not None and self._rebuildable(batches):
            # built only if a spike fires: no per-step tensor work for the no-spike steps
            ctx = functools.partial(lm_spike_context, self.model, batches, self.tokenizer, rng_state=rng)
        self._user_ctx = None
        with self.capture.paused() if self.capture is not None else contextlib.nullcontext():
            self.last = self.monitor.after_backward(step, lr=lr, spike_context=ctx, loss=step_loss(batches),
                                                    sample_losses=step_sample_losses(batches),
                                                    junk_span=step_junk(batches),
                                                    loss_scaler=loss_scaler or self._loss_scaler)
        self._loss_scaler = False
        if self.last.events:
            self.spikes.append(self.last)
            if self.console is not None and self.monitor.rank == 0:  # culprits, or why it was not localized
                self.console.spike(self.last, self.run_dir)
            if self.quarantine is not None and self.last.blamed_rows:  # every rank's culprits, on every rank
                self.quarantine.blame(step, *self.last.blamed_rows)
        self.steps += 1
        return self.last

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to go on as this one would: the step count (the next step's number), the
        clipper's thresholds, the detector's running statistics and the diagnosis' memory (an open incident,
        the run's usual replay scale, ``locate.max_events`` used). Save it with your checkpoint and give it
        to the new handle's ``load_state_dict`` before its first step: without it a resumed run logs from
        step 0 again (over its earlier steps, in a joined run) and AdaGC/ZClip start their warm-up anew."""
        out: dict[str, Any] = {"steps": self.steps}
        if self.monitor.clipper is not None:
            out["clipper"] = self.monitor.clipper.state_dict()
        if self.monitor.detector is not None:
            out["detector"] = self.monitor.detector.state_dict()
            out["diagnosis"] = self.monitor.responder.state_dict()  # the open incident, the usual replay scale
        if self.monitor.scaler_overflows.in_a_row:  # a loss scaler's overflows in a row, toward its limit
            out["overflows_in_a_row"] = self.monitor.scaler_overflows.in_a_row
        if self.quarantine is not None:  # spikes.quarantine: the samples blamed so far stay out after a resume
            out["quarantine"] = self.quarantine.state_dict()
        writer = self.monitor.artifact_writer
        if writer is not None and getattr(writer, "events", 0):  # the run's spike_count goes on from it
            out["spike_count"] = int(writer.events)
        return out

    def _say_if_resumed_without_state(self, numbered: bool = True) -> None:
        """A resumed loop that did not load the handle's state: steps numbered from 0 again, and no spike is
        detected through the detector's new warm-up, silently (held-out tester, stop 55: a junk batch 10 steps
        after such a resume went unseen)."""
        taken = optimizer_steps_taken(self.optimizer)
        warm = self.warm_up_words()
        if self.steps or not taken or self.monitor.rank != 0 or not (warm or numbered):
            return
        said = [*(["steps are numbered from 0 again"] if numbered else []), *([warm] if warm else [])]
        warnings.warn(f"gradloc-track: the optimizer has taken {taken} step(s) before this watch() handle's first (a "
                      f"resumed run?) and no handle state was loaded: {', and '.join(said)}. Save "
                      "handle.state_dict() with your checkpoint and give it to the new handle's load_state_dict() "
                      "(docs/integrations.md, 'Resuming'); a new run on a trained optimizer may ignore this",
                      RuntimeWarning, stacklevel=3)

    def warm_up_words(self, parts: tuple[str, ...] = ("clipper", "detector")) -> str | None:
        """What starts its warm-up anew without saved state, in words (``the clipper and the spike detector start
        their warm-up anew``), naming only what this handle has (held-out tester, stop 63: ``spikes=False`` without
        a clipper was told its detector and clipper warm up anew); None when it has neither."""
        clipper = self.monitor.clipper  # (one with a warm-up: AdaGC, ZClip, LayerClip; a fixed threshold has none)
        held = {"clipper": clipper if getattr(clipper, "warmup_steps", None) else None,
                "detector": self.monitor.detector}
        names = [("the clipper" if p == "clipper" else "the spike detector") for p in parts if held[p] is not None]
        if not names:
            return None
        config = getattr(self.monitor.detector, "config", None)
        blind = f" (no spike is detected for spikes.warmup_steps={config.warmup_steps} steps)" \
            if config is not None and "detector" in parts else ""
        return (f"{' and '.join(names)} start{'s' if len(names) == 1 else ''} "
                f"{'its' if len(names) == 1 else 'their'} warm-up anew{blind}")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved ``state_dict()``. A clipper or detector this handle has and the state lacks (a run
        saved with ``clip=none`` or ``spikes=False``, resumed with one) or holds of another kind (``clip=adagc``
        saved, ``zclip`` now) starts its warm-up, said; one the state holds and this handle lacks is not used, said
        (held-out tester, stop 63: turning detection on at a resume raised in ``train()``, and the only way out
        offered, deleting the state, threw the clipper's away too)."""
        self._resume_checked = True
        said = self.monitor.rank == 0
        for part, held in (("clipper", self.monitor.clipper), ("detector", self.monitor.detector)):
            if (part in state) == (held is not None) or not said:
                continue
            option = "clip=none" if part == "clipper" else "spikes=False"
            if held is not None:
                warm = self.warm_up_words((part,))
                warnings.warn(f"gradloc-track: the saved state has no {part} (saved with {option})"
                              f"{': ' + warm if warm else ''}; the rest of the state is loaded", UserWarning,
                              stacklevel=2)
            else:
                warnings.warn(f"gradloc-track: the saved state's {part} is not used: this handle has {option}",
                              UserWarning, stacklevel=2)
        if "clipper" in state and self.monitor.clipper is not None:
            try:
                check_state(self.monitor.clipper, state["clipper"])
            except ConfigError:  # another clip= kind than the saved one's: its state fits no other
                if said:
                    warm = self.warm_up_words(("clipper",))
                    kind = state_kind(state["clipper"]) if isinstance(state["clipper"], dict) else "?"
                    warnings.warn(f"gradloc-track: the saved clipper state is a clip={kind} clipper's, not used by "
                                  f"this clip={type(self.monitor.clipper).kind} one"
                                  f"{': ' + warm if warm else ''}; the rest of the state is loaded", UserWarning,
                                  stacklevel=2)
            else:
                self.monitor.clipper.load_state_dict(state["clipper"])
        self.steps = int(state["steps"])
        if "detector" in state and self.monitor.detector is not None:
            self.monitor.detector.load_state_dict(state["detector"])
        if "diagnosis" in state and self.monitor.detector is not None:
            self.monitor.responder.load_state_dict(state["diagnosis"])
        self.monitor.scaler_overflows.in_a_row = int(state.get("overflows_in_a_row", 0))
        if self.quarantine is not None and "quarantine" in state:  # (a run without quarantine ignores it)
            self.quarantine.load_state_dict(state["quarantine"])
        writer = self.monitor.artifact_writer
        if writer is not None and hasattr(writer, "events"):  # held-out tester, stop 56: spike_count restarted
            writer.events = max(int(writer.events), int(state.get("spike_count", 0)))  # at 1 after a resume

    def _rebuildable(self, batches: list) -> bool:
        """Can the per-term loss be rebuilt from the captured calls? If not, say why once (naming
        ``set_loss_fn``): spikes are still detected, not localized."""
        why = next((b.unusable for b in batches if b.unusable), None)
        # a spike's record says it too (not "no spike_context passed", which the user never had to pass)
        self.monitor.responder.no_context = None if why is None else f"{why} (handle.set_loss_fn localizes)"
        if why is not None and not self._said_unusable:
            self._said_unusable = True
            warnings.warn(f"gradloc-track: {why}; spikes are detected but not localized. To localize them, "
                          f"{SET_LOSS_FN_HINT}", UserWarning, stacklevel=4)
        return why is None

    # -- the way out -----------------------------------------------------------------------
    def _scaler_update(self) -> None:
        """``scaler.update()`` (``watch(scaler=)``): a step the scaler skipped for its overflow, which the
        optimizer therefore did not take, goes through the monitor as a loss-scaled step; when the loop
        already threw its gradient away (``zero_grad()`` before ``update()``), it is counted and logged as
        skipped without one."""
        stepped, self._stepped = self._stepped, False
        if self._finished or stepped or self._scaler is None or not skipped_by(self._scaler.scaler):
            return
        if any(p.grad is not None for p in self.monitor.params):
            self.step(loss_scaler=True)
            return
        if self.capture is not None:
            self.capture.take()  # its batches do not join the next step's
        self.monitor.scaler_overflows.routine(False, None)
        self.monitor.tracker.log_metrics({"train/skipped_step": 1.0}, self.steps)  # a null tracker off rank 0
        self.steps += 1

    def _unhook(self) -> None:
        if getattr(self, "_scaler", None) is not None:
            self._scaler.remove()
            self._scaler = None
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        if self.capture is not None:
            self.capture.remove()

    def remove(self) -> None:
        """Take every hook off (the optimizer's, the skip guard's, the capture's); logging state is kept."""
        self._unhook()
        if self.monitor.skip_guard is not None:
            self.monitor.skip_guard.remove()
        self.monitor.detector_inputs.remove()

    @property
    def finished(self) -> bool:
        return self._finished

    def flush(self) -> None:
        self.tracker.flush()

    def close(self, status: str = "success") -> None:
        """The one way out: every hook off, then the run closed with ``status`` (a run opened here is
        ended; a joined run, ``wandb.run`` / ``mlflow.active_run()`` / a framework's, stays open for
        its owner; a scratch dir is removed). Idempotent; never raises."""
        if self._finished:
            return
        self._finished = True
        self.remove()
        self.run.close(status)
        if self.run.owned:  # after the tracker has its images; a caller's tracker, finished later, may still
            close = getattr(self.monitor.artifact_writer, "close", None)  # read them: the exit hook removes them
            if close is not None:
                close()

    def finish(self, status: str = "success") -> None:
        """``close(status)``: write everything out, take every hook off, end a run opened here."""
        self.close(status)

    def __enter__(self) -> "WatchHandle":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        from ..trackers.interface import exit_status

        self.close(exit_status(exc_type))  # Ctrl-C: "killed"
