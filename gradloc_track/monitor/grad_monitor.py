"""GradMonitor: per-layer gradient observability, called after ``backward()``.

One fused pass computes every per-tensor squared norm (gradients, and weights on logging
steps); sharded (FSDP2/DTensor) norms are reduced with ONE all-reduce; everything that is logged
is stacked into ONE device tensor and moved to the host once per logging step. Steps that do not
log do no host sync (unless a spike detector is armed with a batch to localize, see
``after_backward``).

Metric keys (``<layer>`` per ``group_by``: block -> ``h.3``, module -> ``h.3.attn.qkv``,
tensor -> the parameter name; or the names of custom ``groups``):

- ``grad_norm/global``: L2 norm of all gradients (before clipping)
- ``grad_norm/<layer>``: L2 norm of the layer's gradients
- ``grad_norm/tensor/<param>``: per-tensor norms (``per_tensor=True``)
- ``grad_norm/nonfinite``: number of tensors whose gradient norm is NaN/Inf (logged, never
  raised: the clipper's ``on_nonfinite`` decides what happens to the step)
- ``weight_norm/global``, ``weight_norm/<layer>``: parameter norms (``weight_norms=True``)
- ``grad_weight_ratio/<layer>``: ``||g|| / ||w||`` of the layer (``weight_norms=True``)
- ``lr``, ``weight_decay``: when known (arguments, else ``optimizer.param_groups``: ``lr`` of
  group 0, the largest ``weight_decay`` of any group, since no-decay groups hold 0); ``lr``
  is the one applied at this step, ``weight_decay`` is logged only when it changes
- ``adamc/steady_state_ratio`` (``adamc_ratio=True``, or automatically when
  ``AdamCWeightDecay`` drives the optimizer): ``sqrt(2 * weight_decay / lr)``, the ratio ``||g||/||w||``
  that decoupled weight decay drives normalized layers to (Defazio, arXiv 2506.02285); a
  ``grad_weight_ratio`` tracking it as ``lr -> 0`` is schedule-driven norm growth, not a spike
- ``clip/threshold/global``, ``clip/threshold/<layer>`` (the thresholds in force; left out
  while none is), ``clip/coef/<layer>``, ``clip/clipped_fraction``,
  ``clip/saturation/clipped_fraction``, ``clip/saturation/mean_coef`` (after the clipper's
  warm-up: share of recent steps scaled and their mean coefficient; a warning when clipping
  has become a learning-rate cut), ``clip/total_norm_pre``, ``clip/total_norm_post``,
  ``clip/nonfinite``: from the clipper (see ``gradloc_track.clip.metrics``)
- ``spike/detected`` (1 on a step the detector fired), ``spike/detected_total``,
  ``spike/threshold`` (the global norm that would fire this step on its own, without the broad rule: plot it with
  ``grad_norm/global``), ``spike/ratio`` (global norm / its running baseline),
  ``spike/zscore``, ``spike/zscore_max_layer``, ``spike/zscore_loss``, ``spike/zscore_sample_loss``,
  ``spike/zscore_update`` (the step's loss, largest per-sample loss and optimizer update, when the step
  gives them), ``spike/noise_floor`` (1: the gradient norm is float noise, skipped),
  ``spike/transient`` (1 while early training's fall keeps norm-only jumps from firing),
  ``spike/olmo_score`` (OLMo-core's 6-sigma spike score, for comparison): from the detector's
  ``metrics()`` (``SpikeDetector`` documents them)
- ``locate/probes``, ``locate/culprits``, ``locate/threshold``, ``locate/seconds`` when a
  spike was localized; ``locate/failed`` when localizing raised (a warning, never a crash)
- ``surgery/applied`` (1: the culprits' gradient was removed, 0: nothing was, ``stats.surgery.reason``
  says why), ``surgery/removed_share`` (the share of the step's squared gradient norm removed),
  ``surgery/grad_norm_post`` (the norm the clipper then sees): on spikes, with ``spikes.response=surgery``

With ``spikes.response=surgery`` (and a detector armed with a spike context) the clipper runs
after the detector's verdict: on a localized spike the culprits' exact gradient is removed from
``.grad`` first (``gradloc_track.localizer.surgery``) and the clipper clips what is left
(``clip/total_norm_pre`` is then the operated norm; the grad norms stay the step's own). The clip
metrics then take a second, small host transfer on logging steps.
"""
from __future__ import annotations

import contextlib
import functools
import math
import warnings
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from ..clip.simple import NoClip
from ..config import LocateConfig, MonitorConfig, SpikeConfig
from ..norms import all_reduce_sq_norms, sq_norms
from ..protocols import ArtifactWriterLike, ClipperLike, DetectorLike
from ..spikes.context import check_spike_context
from ..spikes.event import SpikeEvent
from ..trackers.interface import NullTracker, Tracker
from .arguments import (as_detector, as_locate_config, as_monitor_config, check_arguments, needs_token_count,
                        response_mode)
from .clip_feedback import after_transfer, install_guard, note_norms
from .cause_evidence import LrHistory
from .clip_scale import localizer_scale, optimizer_scale
from .data_flags import flag_rule
from .detector_inputs import WEIGHT_BAD, DetectorInputs
from .junk_window import window_text
from .outcome import SpikeOutcome
from .optimizer_metrics import OptimizerMetrics
from .packing import LR, N_TOKENS, WD, HostPack, add_clip, add_norms, loggable
from .joined import JoinedTensors
from .param_set import ParamSet
from .rank_wait import waiting
from .responder import SpikeResponder
from .scaler_overflow import ScalerOverflows
from .stats import GradStats
from .step_order import StepOrder, WarnOnce, checked_step


class HostReading(NamedTuple):
    """One step's values on the host (``GradMonitor._sync``): the metrics to log, the norms
    (``{"global", "tensor", "layer"}``), the spike context's token and micro-batch counts (None without
    one) and the detector's inputs beyond the norms (``DetectorInputs.read``)."""

    metrics: dict[str, float]
    host: dict[str, Any]
    n_tokens: int | None
    n_micro: int | None
    signals: dict[str, Any]


class GradMonitor:
    """Logs gradient health after ``loss.backward()`` and before ``optimizer.step()``.

    ```python
    monitor = GradMonitor(model, tracker=tracker, clipper=clipper, optimizer=opt, log_every=10)
    loss.backward()
    stats = monitor.after_backward(step)   # norms, clipping, spike detection, localization
    optimizer.step()
    ```

    The metric keys it logs are listed in this module's docstring (and docs/metrics.md).

    With ``optimizer=`` the optimizer gets a ``SkipStepGuard`` (``skip_guard``), clipper or not
    (without one, or with ``on_nonfinite="skip"``; ``clip.skip_step``, ``"off"`` to opt out): a step
    with a non-finite gradient leaves parameters and optimizer state bitwise unchanged, free for
    fused optimizers, one bool read per step otherwise (none on steps this monitor already synced),
    and a clipper makes one pass less over the gradients (see ``gradloc_track.clip.skip_step``).

    Only global rank 0 logs (other ranks get a ``NullTracker``). A spike on a non-logging step
    is logged at its own step (its norms, spike and locate keys).

    Parameters unfrozen (or frozen) after construction are picked up on the next step that syncs
    (a logging step, or any step while a detector is armed): the check is one pass over the
    ``requires_grad`` flags there, nothing on other steps. A clipper built before the unfreezing
    does not clip the new tensors (a warning says so). ``after_backward`` must be called once per
    optimizer step with an increasing step: a repeated step is ignored with a warning (clip and
    detector state advance once), a step that goes backwards is processed with a warning.
    A localization that finds no culprit (at any level) does not use up ``locate.max_events``.
    """

    def __init__(self, model: torch.nn.Module, tracker: Tracker | None = None, clipper: ClipperLike | None = None,
                 config: MonitorConfig | None = None, *, optimizer: torch.optim.Optimizer | None = None,
                 process_group: Any = None, detector: DetectorLike | SpikeConfig | None = None,
                 locate_config: LocateConfig | None = None, artifact_writer: ArtifactWriterLike | None = None,
                 **overrides: Any) -> None:
        config = as_monitor_config(config, overrides)
        check_arguments(model, tracker, clipper, optimizer, detector, artifact_writer)
        self.config, self.model, self.optimizer, self.clipper = config, model, optimizer, clipper
        self.process_group = process_group
        self.detector: DetectorLike | None = as_detector(detector)
        self.locate_config = as_locate_config(locate_config)
        self.artifact_writer = artifact_writer
        self.rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        # only rank 0 logs; the others get the do-nothing tracker (no branching at call sites)
        self.tracker: Tracker = (tracker or NullTracker()) if self.rank == 0 else NullTracker()
        self._warn_once = WarnOnce()
        self.step_order = StepOrder(self._warn_once)
        self.param_set = ParamSet(model, config, clipper, self._warn_once)
        self.optimizer_metrics = OptimizerMetrics(optimizer, config.adamc_ratio)
        surgery = response_mode(detector, self.locate_config) == "surgery"
        self.responder = SpikeResponder(model, self.locate_config, config.group_by, artifact_writer,
                                            self.rank, process_group, self._warn_once, surgery=surgery,
                                            clips=clipper is not None and not isinstance(clipper, NoClip))
        # a non-finite step skipped for real by the optimizer, clipper or not (see monitor.clip_feedback)
        self.skip_guard = install_guard(optimizer, clipper, self.params[0].device)
        # only GradLoc's fixed trigger reads the step's token count (an adaptive SpikeDetector does not)
        self._detector_counts_tokens = needs_token_count(self.detector)
        # the detector's inputs beyond the norms: loss, largest sample loss, the optimizer's update, weight norm
        self.detector_inputs = DetectorInputs(self.detector, optimizer, self.params, process_group)
        self._weight_norm_seen = math.nan  # the last finite weight_norm/global read (a corrupt weight's event says it)
        # the learning rate of each step the detector sees: a jump names a spike's cause (schedule)
        self.responder.lr_history = LrHistory(optimizer) if optimizer is not None else None
        self.joined = JoinedTensors(optimizer)  # tensors unfrozen or added at a step: the cause names them
        self.scaler_overflows = ScalerOverflows()  # a GradScaler's routine overflows in a row
        self.responder.flag_rule = flag_rule(self.detector)  # the units its data signals name when they fire

    # -- public --------------------------------------------------------------------------
    @property
    def names(self) -> list[str]:
        return self.param_set.names

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return self.param_set.params

    @property
    def grouping(self):
        return self.param_set.grouping

    @property
    def events_localized(self) -> int:
        """Localizations that named a culprit (these use up ``locate.max_events``)."""
        return self.responder.events_localized

    @property
    def events_unconfirmed(self) -> int:
        """Localizations that found nothing (the localizer backs off after ``max_events`` of them)."""
        return self.responder.events_unconfirmed

    def should_log(self, step: int) -> bool:
        return step % self.config.log_every == 0

    @torch.no_grad()
    def after_backward(self, step: int, *, lr: float | None = None, weight_decay: float | None = None,
                       spike_context: Any = None, loss: Any = None, sample_losses: Any = None,
                       junk_span: Any = None, loss_scaler: bool = False) -> GradStats:
        """Compute norms, clip, detect and localize spikes (and operate on them with
        ``spikes.response=surgery``, before clipping), and log. Returns ``GradStats``.

        Host syncs: one transfer on logging steps; none on other steps, except when a detector
        AND a ``spike_context`` are given: then every step makes that one transfer (global,
        per-layer and per-tensor norms, clip metrics, the token count: a few KB; the cost is the
        wait for the device to finish backward, not the bytes) so a spike on any step can be
        detected and localized. With a detector but no ``spike_context`` the detector only sees
        logging steps. Weight norms are computed on logging steps only. ``spike_context`` may be a
        zero-argument callable returning the ``SpikeContext``: it is called only when a spike fires
        (or every armed step for a ``fixed``-mode detector, which needs the token count). ``loss`` (the
        step's training loss, a tensor or a number: the mean over its loss terms, in nats, not divided by the
        accumulation steps) and ``sample_losses`` (each sample's mean loss: a
        (B,) tensor, or one per micro-batch; ``gradloc_track.spikes.sample_losses`` computes it as
        ``watch()`` does) feed the detector's loss signals when given (their floors, ``spikes.loss_min_rise``
        and ``sample_min_rise``, are in nats);
        ``junk_span`` (``gradloc_track.spikes.junk.junk_span(logits, targets, input_ids)``, or one per
        micro-batch) feeds the junk signal (a run of terms the model rates below chance);
        they ride in the same transfer, as does the optimizer's update (``spikes.update_signal``).
        ``loss_scaler``: the gradients came from a loss scaler that skips a non-finite step itself
        (``torch.amp.GradScaler``); its routine overflow is logged as ``train/skipped_step``, not a spike
        (``monitor.scaler_overflow``).
        Collectives: at most one all-reduce per step (sharded/DTensor gradients only; grad and
        weight norms share it), plus the global token count on armed steps of a ``fixed``-mode
        detector. Under torch.distributed every rank sees the same reduced norms, so every rank
        decides alike and localizes together (``locate`` is then a collective).
        """
        step = checked_step(step)
        if spike_context is not None:
            check_spike_context(spike_context)
        if self.step_order.repeated(step):  # a second call for a step already processed: touch nothing
            return GradStats(step, self.grouping, self._global_sq_norms(False)[0], logged=False)
        log_now = self.should_log(step)
        armed = self.detector is not None and spike_context is not None
        if (log_now or armed) and self.param_set.changed():
            self.joined.adopted(step, self.param_set.rescan(step))
        want_w = log_now and self.config.weight_norms
        need_w = (log_now or armed) and self.detector_inputs.needs_weights  # the noise floor's scale, once
        grad_sq, w_sq = self._global_sq_norms(want_w or need_w)  # (n,), (n,)|None device
        self.detector_inputs.stage(loss, sample_losses, w_sq, junk_span)
        w_sq = w_sq if want_w else None
        # spike surgery operates on the gradient as backward left it: the clipper waits for the verdict
        clip_later = armed and self.responder.surgery
        clip_result = None if clip_later else self._clip(step, grad_sq, w_sq, lr, weight_decay)
        if not (log_now or armed):  # nothing leaves the device
            return GradStats(step, self.grouping, grad_sq, logged=False, clip=clip_result)
        reading = self._sync(grad_sq, w_sq, clip_result, lr, weight_decay, spike_context if armed else None)
        outcome = None
        if self.detector is not None:
            outcome = self._detect(step, reading, spike_context, clip_result, junk_span, loss_scaler)
        if clip_later:
            clip_result = self._clip_operated(step, outcome, reading.metrics, grad_sq, w_sq, lr, weight_decay,
                                              log_now)
        if log_now or outcome is not None or "train/skipped_step" in reading.metrics:
            self.tracker.log_metrics(reading.metrics, step)
        return GradStats(step, self.grouping, grad_sq, logged=log_now, metrics=reading.metrics, clip=clip_result,
                         host=reading.host, outcome=outcome)

    # -- the steps of after_backward ----------------------------------------------------------
    def _global_sq_norms(self, with_weights: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-tensor squared grad (and weight) norms, globally reduced with ONE all-reduce."""
        params = self.params
        grads = [p.grad for p in params]
        if not with_weights:
            return all_reduce_sq_norms(sq_norms(grads), grads, self.process_group), None  # (n,) device
        # gradients and weights in one fused pass (one group when they share device and dtype)
        both = all_reduce_sq_norms(sq_norms(grads + params), grads + params, self.process_group)  # (2n,)
        n = len(params)
        return both[:n], both[n:]

    def _clip(self, step: int, grad_sq: torch.Tensor, w_sq: torch.Tensor | None, lr: Any, weight_decay: Any) -> Any:
        """The clipper, on the norms already computed; on_nonfinite="raise": log this step first."""
        note_norms(self.skip_guard, grad_sq)  # the guard's flag when no clipper sets it
        try:
            return self.param_set.clip(grad_sq)
        except FloatingPointError:
            self._log_before_raise(step, grad_sq, w_sq, lr, weight_decay)
            raise

    def _clip_operated(self, step: int, outcome: SpikeOutcome | None, metrics: dict[str, float],
                       grad_sq: torch.Tensor, w_sq: torch.Tensor | None, lr: Any, weight_decay: Any,
                       log_now: bool) -> Any:
        """``spikes.response=surgery``: the clipper runs after the detector's verdict, on the gradient
        surgery left (its norms taken again only when surgery removed something); its metrics come
        in a second, small transfer on steps that log. Returns the ``ClipResult``."""
        if outcome is not None and outcome.surgery is not None and outcome.surgery.applied:
            grad_sq = self._global_sq_norms(False)[0]  # (n,) device: the operated gradient
        clip = self._clip(step, grad_sq, w_sq, lr, weight_decay)
        if clip is None or not (log_now or outcome is not None):
            return clip
        pack = HostPack(grad_sq.device)
        add_clip(pack, self.param_set, clip)
        host = pack.to_host().metrics  # host sync: the clip metrics, known only after the verdict
        after_transfer(self.clipper, host, self._warn_once)
        metrics.update(loggable(host, self.config.per_tensor))
        return clip

    def _sync(self, grad_sq: torch.Tensor, w_sq: torch.Tensor | None, clip_result: Any, lr: Any,
              weight_decay: Any, spike_context: Any) -> HostReading:
        """Everything this step logs or detects on, moved to the host in ONE transfer."""
        pack = HostPack(grad_sq.device)
        add_norms(pack, self.param_set, grad_sq, w_sq, clip_result)
        lr, weight_decay = self.optimizer_metrics.read(lr, weight_decay)
        pack.add_slot_if_tensor(LR, lr)
        pack.add_slot_if_tensor(WD, weight_decay)
        n_tokens = n_micro = None
        if spike_context is not None and self._detector_counts_tokens:
            n_tokens, n_micro = self.responder.count_tokens(pack, spike_context)
        if self.detector is not None:
            after_verdict = spike_context is not None and self.responder.surgery
            scale = optimizer_scale(self.param_set, self.clipper, clip_result, after_verdict)
            self.detector_inputs.add(pack, self.params, grad_sq, scale)
        # an accelerator's collective is waited for in this transfer, not at its call
        gathered = self.detector is not None and self.detector_inputs.gathered and grad_sq.device.type != "cpu"
        with waiting(f"rank {self.rank}'s step (the spike detector's all-gather) at optimizer.step()") if gathered \
                else contextlib.nullcontext():
            values = pack.to_host()
        host, slots = values.metrics, values.slots
        signals = self.detector_inputs.read(slots, nonfinite=host["grad_norm/nonfinite"] > 0)
        after_transfer(self.clipper, host, self._warn_once, self.skip_guard)
        lr, weight_decay = slots.get(LR, lr), slots.get(WD, weight_decay)
        if N_TOKENS in slots:
            n_tokens = int(slots[N_TOKENS])
        metrics = loggable(host, self.config.per_tensor)
        metrics.update(self.optimizer_metrics.metrics(lr, weight_decay))
        norms = {"global": host["grad_norm/global"], "tensor": [host[k] for k in self.param_set.tensor_keys],
                 "layer": [host[k] for k in self.param_set.layer_keys]}
        return HostReading(metrics, norms, n_tokens, n_micro, signals)

    def _detect(self, step: int, reading: HostReading, spike_context: Any, clip: Any,
                junk: Any = None, loss_scaler: bool = False) -> SpikeOutcome | None:
        """The detector's verdict on this step; a spike is handed to the responder (localized, or recorded
        with the reason it was not), whose ``SpikeOutcome`` this returns. ``junk``: the junk statistics
        given, whose run's text the detector reads only if it would fire on it. ``loss_scaler``: a loss
        scaler's routine overflow is no spike (``monitor.scaler_overflow``)."""
        n_tokens, signals = reading.n_tokens, dict(reading.signals)
        weight_bad = signals.pop(WEIGHT_BAD, False)  # the monitor's own reading, not the detector's
        if loss_scaler and self.scaler_overflows.routine(math.isfinite(reading.host["global"]),
                                                         signals.get("loss")):
            reading.metrics.update({"spike/detected": 0.0, "train/skipped_step": 1.0})
            return None
        if n_tokens is not None and self._detector_counts_tokens:
            n_tokens = self.responder.global_count(n_tokens, self.params[0].device)
        if "junk_span" in signals and junk is not None:
            signals = {**signals, "junk_text": functools.partial(
                window_text, junk, spike_context, self.detector.config.junk_terms, self.process_group,
                self.detector.config.junk_margin)}
        extra = {"n_micro_batches": reading.n_micro} if reading.n_micro is not None else {}
        layers = dict(zip(self.grouping.layers, reading.host["layer"]))
        events = self.detector.update(step, reading.host["global"], layers, n_tokens=n_tokens, **extra, **signals)
        weight_norm = reading.metrics.get("weight_norm/global")
        if weight_norm is not None and math.isfinite(weight_norm):
            self._weight_norm_seen = weight_norm
        if not events:
            events = self._corrupt_weight_event(step, weight_norm, weight_bad)
        reading.metrics.update(self.detector.metrics())
        if self.responder.lr_history is not None:
            self.responder.lr_history.advance()  # this step's learning rate, against the last seen
        self.joined.advance(step)
        if not events:
            return None
        self.responder.joined = self.joined.names(step, list(zip(self.names, self.params)))
        self.detector_inputs.fired()
        outcome, metrics = self.responder.respond(step, events, spike_context,
                                                  localizer_scale(self.param_set, self.clipper, clip), junk)
        reading.metrics.update(metrics)
        return outcome

    def _corrupt_weight_event(self, step: int, weight_norm: float | None, bad: bool) -> list[SpikeEvent]:
        """A weight norm that is not finite on a step nothing fired on: behind a norm layer a 1e36 weight leaves
        the loss and the gradient ordinary, and the weight check ran on detected steps only (held-out tester,
        stop 52: ``weight_norm/global`` logged inf for 70 steps, nothing said). ``bad``: some rank's weight norm
        is not finite (combined across ranks with the step's other detector inputs: a bit flipped on one
        replica is seen by all, which must all scan, the scan being a collective). A corrupt weight is the
        step's event, its incident opened; while it stays, nothing more is raised."""
        known = self.responder.corrupt
        if not bad or (known is not None and known.step == step):
            return []
        self.responder.check_weights(step)
        if self.responder.corrupt is None or self.responder.corrupt is known:
            return []
        return [SpikeEvent(step, "weight_norm", math.inf if weight_norm is None else weight_norm,
                           self._weight_norm_seen, math.inf, math.inf)]

    # -- step order, the raise path -------------------------------------------------------------
    def _log_before_raise(self, step: int, grad_sq: torch.Tensor, w_sq: torch.Tensor | None, lr: Any,
                          weight_decay: Any) -> None:
        """The clipper raises on a non-finite gradient (``on_nonfinite="raise"``): log and flush this
        step's norms first, so the run shows where and in which layers it broke."""
        try:  # host sync: the error path
            metrics = self._sync(grad_sq, w_sq, None, lr, weight_decay, None).metrics
            metrics["clip/nonfinite"] = 1.0
            self.tracker.log_metrics(metrics, step)
            self.tracker.flush()
        except Exception as exc:  # the clipper's error is the one to raise
            warnings.warn(f"gradloc-track: could not log step {step} before raising: {exc!r}")
