"""GradMonitor: per-layer gradient observability, called after ``backward()``.

One fused pass computes every per-tensor squared norm (gradients, and weights on logging
steps); sharded (FSDP2/DTensor) norms are reduced with ONE all-reduce; everything that is logged
is stacked into ONE device tensor and moved to the host once per logging step. Steps that do not
log do no host sync (unless a spike detector is armed with a batch to localize, see
``after_backward``).
"""
from __future__ import annotations

import logging
import math
import warnings
from dataclasses import fields
from typing import Any

import torch
import torch.distributed as dist

from .config import LocateConfig, MonitorConfig
from .config.monitor import RESERVED_LAYER_NAMES
from .grouping import LayerGrouping
from .monitor_args import as_detector, as_locate_config, check_arguments
from .monitor_stats import GradStats
from .norms import all_reduce_sq_norms, sq_norms, trainable_params
from .trackers.base import NullTracker, Tracker

__all__ = ["GradMonitor", "GradStats"]

log = logging.getLogger(__name__)

_N_TOKENS = "\0n_tokens"  # internal pack slots, never logged
_LR, _WD = "\0lr", "\0weight_decay"


class _Pack:
    """Collects named device values so one ``torch.cat(...).tolist()`` moves them all."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.keys: list[str] = []
        self.parts: list[torch.Tensor] = []

    def add(self, keys: list[str], values: torch.Tensor) -> None:
        self.keys += keys
        self.parts.append(values.detach().reshape(-1).to(self.device, torch.float32))

    def to_host(self) -> dict[str, float]:
        values = torch.cat(self.parts).tolist()  # THE host sync of this step (one transfer)
        return dict(zip(self.keys, values))


class GradMonitor:
    """Logs gradient health after ``loss.backward()`` and before ``optimizer.step()``.

    ```python
    monitor = GradMonitor(model, tracker=tracker, clipper=clipper, optimizer=opt, log_every=10)
    loss.backward()
    stats = monitor.after_backward(step)   # norms, clipping, spike detection, localization
    optimizer.step()
    ```

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
    - ``clip/threshold/<layer>`` (or ``clip/threshold/global``), ``clip/coef/<layer>``,
      ``clip/clipped_fraction``, ``clip/total_norm_pre``, ``clip/total_norm_post``,
      ``clip/nonfinite``: from the clipper (see ``gradloc_track.clip.metrics``)
    - ``spike/detected`` (1 on a step the detector fired), ``spike/detected_total``,
      ``spike/threshold`` (the global norm that would fire this step: plot it with
      ``grad_norm/global``), ``spike/ratio`` (global norm / its running baseline),
      ``spike/zscore``, ``spike/zscore_max_layer``, ``spike/olmo_score`` (OLMo-core's 6-sigma
      spike score, for comparison): from the detector's ``metrics()`` (``SpikeDetector`` documents them)
    - ``locate/probes``, ``locate/culprits``, ``locate/threshold``, ``locate/seconds`` when a
      spike was localized; ``locate/failed`` when localizing raised (a warning, never a crash)

    Only global rank 0 logs (other ranks get a ``NullTracker``). A spike on a non-logging step
    is logged at its own step (its norms, spike and locate keys).

    Parameters unfrozen (or frozen) after construction are picked up on the next step that syncs
    (a logging step, or any step while a detector is armed): the check is one pass over the
    ``requires_grad`` flags there, nothing on other steps. A clipper built before the unfreezing
    does not clip the new tensors (a warning says so). ``after_backward`` must be called once per
    optimizer step with an increasing step: a repeated step is ignored with a warning (clip and
    detector state advance once), a step that goes backwards is processed with a warning.
    A localization that finds no culprit token does not use up ``locate.max_events``.
    """

    def __init__(self, model: torch.nn.Module, tracker: Tracker | None = None, clipper: Any = None,
                 config: MonitorConfig | None = None, *, optimizer: torch.optim.Optimizer | None = None,
                 process_group: Any = None, detector: Any = None, locate_config: LocateConfig | None = None,
                 artifact_writer: Any = None, **overrides: Any) -> None:
        if config is None:
            known = {f.name for f in fields(MonitorConfig)}
            unknown = set(overrides) - known
            if unknown:
                raise TypeError(f"GradMonitor got unknown option(s) {sorted(unknown)}; "
                                f"valid options are the MonitorConfig fields {sorted(known)}")
            config = MonitorConfig(**overrides)
        elif overrides:
            raise TypeError("GradMonitor: pass either config=MonitorConfig(...) or option keywords "
                            f"({sorted(overrides)}), not both")
        if not isinstance(config, MonitorConfig):
            raise TypeError(f"GradMonitor: config must be a gradloc_track.config.MonitorConfig, "
                            f"got {type(config).__name__}")
        check_arguments(model, tracker, clipper, optimizer, detector, artifact_writer)
        self.config = config
        self.model = model
        self.optimizer = optimizer
        self.process_group = process_group
        self.clipper = clipper
        self.detector = as_detector(detector)
        self.locate_config = as_locate_config(locate_config)
        self.artifact_writer = artifact_writer
        self.rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        # only rank 0 logs; the others get the do-nothing tracker (no branching at call sites)
        self.tracker: Tracker = (tracker or NullTracker()) if self.rank == 0 else NullTracker()
        self._warned: set[str] = set()
        self._last_step: int | None = None
        self.events_localized = 0  # localizations that found a culprit (these use up locate.max_events)
        self.events_unconfirmed = 0  # localizations that found nothing (they back off instead)
        self._retry_step = -(2 ** 62)  # no localization before this step (back-off after empty results)
        self._scan_params()

    def _scan_params(self) -> None:
        """(Re)build everything that depends on which parameters require grad."""
        named = trainable_params(self.model)
        if not named:
            raise ValueError("GradMonitor: the model has no parameters with requires_grad=True")
        names = [n for n, _ in named]
        grouping = LayerGrouping.build(names, self.config.group_by, self.config.groups or None)
        layers = grouping.layers
        clash = RESERVED_LAYER_NAMES.intersection(layers)
        if clash:
            raise ValueError(f"GradMonitor: layer name(s) {sorted(clash)} would clash with grad_norm/global or "
                             "grad_norm/nonfinite; rename them with monitor.groups={name: regex}")
        # every check passed: only now replace the monitored set (a failed rescan changes nothing)
        self.names, self.params, self.grouping = names, [p for _, p in named], grouping
        # the requires_grad pattern of every parameter: compared on syncing steps to pick up
        # parameters unfrozen (or frozen) after the monitor was built
        self._all_params = list(self.model.parameters())
        self._trainable_flags = [p.requires_grad for p in self._all_params]
        self._layer_keys = [f"grad_norm/{lay}" for lay in layers]
        self._tensor_keys = [f"grad_norm/tensor/{n}" for n in self.names]
        self._weight_keys = ["weight_norm/global"] + [f"weight_norm/{lay}" for lay in layers]
        self._ratio_keys = [f"grad_weight_ratio/{lay}" for lay in layers]
        self._clip_index = self._clipper_index()
        self._clip_index_t: torch.Tensor | None = None  # the same index on the gradients' device
        # clip metrics are grouped over the clipper's own tensors when they differ from ours
        self._clip_grouping = self.grouping if self._clip_index is None else LayerGrouping.build(
            list(self.clipper.names), self.config.group_by, self.config.groups or None)

    # -- public --------------------------------------------------------------------------
    def should_log(self, step: int) -> bool:
        return step % self.config.log_every == 0

    @torch.no_grad()
    def after_backward(self, step: int, *, lr: float | None = None, weight_decay: float | None = None,
                       spike_context: Any = None) -> GradStats:
        """Compute norms, clip, detect and localize spikes, and log. Returns ``GradStats``.

        Host syncs: one transfer on logging steps; none on other steps, except when a detector
        AND a ``spike_context`` are given: then every step makes that one transfer (global,
        per-layer and per-tensor norms, clip metrics, the token count: a few KB; the cost is the
        wait for the device to finish backward, not the bytes) so a spike on any step can be
        detected and localized. With a detector but no ``spike_context`` the detector only sees
        logging steps. Weight norms are computed on logging steps only.
        Collectives: at most one all-reduce per step (sharded/DTensor gradients only; grad and
        weight norms share it), plus the global token count on armed steps of a ``fixed``-mode
        detector. Under torch.distributed every rank sees the same reduced norms, so every rank
        decides alike and localizes together (``locate`` is then a collective).
        """
        if self._repeated_step(step):  # a second call for a step already processed: touch nothing
            return GradStats(step, self.grouping, self._global_sq_norms(False)[0], logged=False)
        log_now = self.should_log(step)
        armed = self.detector is not None and spike_context is not None
        if (log_now or armed) and self._params_changed():
            self._rescan(step)
        with_weights = log_now and self.config.weight_norms
        grad_sq, w_sq = self._global_sq_norms(with_weights)  # (n,), (n,)|None device
        try:
            clip_result = self._clip(grad_sq)
        except FloatingPointError:  # on_nonfinite="raise": log this step's norms first, then raise
            self._log_before_raise(step, grad_sq, w_sq, lr, weight_decay)
            raise
        if not (log_now or armed):  # nothing leaves the device
            return GradStats(step, self.grouping, grad_sq, logged=False, clip=clip_result)

        pack, lr, weight_decay, n_tokens, n_micro = self._pack(grad_sq, w_sq, clip_result, lr, weight_decay,
                                                               spike_context if armed else None)
        host = pack.to_host()
        tensor_vals = [host[k] for k in self._tensor_keys]
        layer_vals = [host[k] for k in self._layer_keys]
        lr = host.pop(_LR, lr)
        weight_decay = host.pop(_WD, weight_decay)
        if _N_TOKENS in host:
            n_tokens = int(host.pop(_N_TOKENS))
        if n_tokens is not None and getattr(getattr(self.detector, "config", None), "mode", None) == "fixed":
            n_tokens = self._global_count(n_tokens)
        metrics = {k: v for k, v in host.items() if self.config.per_tensor or not k.startswith("grad_norm/tensor/")}
        metrics.update(self._lr_metrics(lr, weight_decay))
        stats = GradStats(step, self.grouping, grad_sq, logged=log_now, metrics=metrics, clip=clip_result,
                          host={"global": host["grad_norm/global"], "tensor": tensor_vals, "layer": layer_vals})

        if self.detector is not None:
            extra = {"n_micro_batches": n_micro} if n_micro is not None else {}
            stats.events = list(self.detector.update(step, host["grad_norm/global"], stats.layer_norms,
                                                     n_tokens=n_tokens, **extra))
            metrics.update(self.detector.metrics())
            if stats.events and spike_context is not None:
                metrics.update(self._localize(step, stats, spike_context))
        if log_now or stats.events:
            self.tracker.log_metrics(metrics, step)
        return stats

    # -- internals -----------------------------------------------------------------------
    def _global_sq_norms(self, with_weights: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-tensor squared grad (and weight) norms, globally reduced with ONE all-reduce."""
        grads = [p.grad for p in self.params]
        g_local = sq_norms(grads)  # (n,) device, local shards
        if not with_weights:
            return all_reduce_sq_norms(g_local, grads, self.process_group), None
        w_local = sq_norms([p.detach() for p in self.params], device=g_local.device)  # (n,)
        both = all_reduce_sq_norms(torch.cat([g_local, w_local]), grads + self.params, self.process_group)
        n = len(self.params)
        return both[:n], both[n:]

    # -- step order, parameter set, clipping, the raise path ------------------------------
    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(f"gradloc-track: {message}", stacklevel=3)

    def _repeated_step(self, step: int) -> bool:
        """True for a second call with the step just processed (it must change nothing)."""
        last, self._last_step = self._last_step, step
        if last is not None and step == last:
            self._warn_once("repeat", f"GradMonitor.after_backward was called again for step {step}; the repeated "
                            "call is ignored (no clipping, spike detection or logging: their state advances once "
                            "per step). Call it once per optimizer step, after the last micro-batch's backward, "
                            "with a step that increases.")
            return True
        if last is not None and step < last:
            self._warn_once("backwards", f"GradMonitor.after_backward: the step went backwards ({last} -> {step}). "
                            "Its gradients are clipped and checked as a new step, but trackers keep one value per "
                            "step (W&B drops steps below its current one): pass a step that increases, e.g. the "
                            "global optimizer step rather than a per-epoch counter.")
        return False

    def _params_changed(self) -> bool:
        """Did any parameter's requires_grad flip since the last scan? (syncing steps only: O(#params))"""
        return [p.requires_grad for p in self._all_params] != self._trainable_flags

    def _rescan(self, step: int) -> None:
        """Pick up parameters unfrozen (and drop ones frozen) after the monitor was built."""
        before = set(self.names)
        try:
            self._scan_params()
        except ValueError:  # every parameter frozen for now: keep the last set, look again later
            self._trainable_flags = [p.requires_grad for p in self._all_params]
            return
        added = [n for n in self.names if n not in before]
        removed = sorted(before - set(self.names))
        log.info("gradloc-track: step %d: now monitoring %d newly trainable parameter(s) %s%s", step, len(added),
                 added[:8], f"; no longer monitoring {removed[:8]}" if removed else "")

    def _clipper_index(self) -> Any:
        """How the clipper's tensors map onto the monitored ones.

        None: the same tensors in the same order (the norms are handed over as they are); a list
        of indices: the clipper holds a subset (it was built while some parameters were frozen);
        ``"own"``: it holds tensors the monitor does not (it computes its own norms).
        """
        names = getattr(self.clipper, "names", None)
        if self.clipper is None or names is None or list(names) == self.names:
            return None
        unclipped = sorted(set(self.names) - set(names))
        if unclipped:
            self._warn_once("unclipped", f"parameter(s) {unclipped[:8]}{' ...' if len(unclipped) > 8 else ''} are "
                            f"monitored but not clipped: the {type(self.clipper).__name__} was built while they "
                            "were frozen. Build the clipper again after unfreezing them.")
        pos = {n: i for i, n in enumerate(self.names)}
        return [pos[n] for n in names] if all(n in pos for n in names) else "own"

    def _clip(self, grad_sq: torch.Tensor) -> Any:
        if self.clipper is None:
            return None
        index = self._clip_index
        if index is None:
            return self.clipper.clip(grad_sq)
        if index == "own":
            return self.clipper.clip()
        t = self._clip_index_t
        if t is None or t.device != grad_sq.device:  # once: a host->device copy waits for the device
            t = self._clip_index_t = torch.as_tensor(index, device=grad_sq.device)
        return self.clipper.clip(grad_sq[t])

    def _log_before_raise(self, step: int, grad_sq: torch.Tensor, w_sq: torch.Tensor | None, lr: Any,
                          weight_decay: Any) -> None:
        """The clipper raises on a non-finite gradient (``on_nonfinite="raise"``): log and flush this
        step's norms first, so the run shows where and in which layers it broke."""
        try:
            pack, lr, weight_decay, _, _ = self._pack(grad_sq, w_sq, None, lr, weight_decay, None)
            host = pack.to_host()  # host sync: the error path
            lr, weight_decay = host.pop(_LR, lr), host.pop(_WD, weight_decay)
            metrics = {k: v for k, v in host.items() if self.config.per_tensor or not k.startswith("grad_norm/tensor/")}
            metrics.update(self._lr_metrics(lr, weight_decay))
            metrics["clip/nonfinite"] = 1.0
            self.tracker.log_metrics(metrics, step)
            self.tracker.flush()
        except Exception as exc:  # the clipper's error is the one to raise
            warnings.warn(f"gradloc-track: could not log step {step} before raising: {exc!r}")

    def _count_localization(self, step: int, found: bool) -> None:
        """Only a localization that names a culprit uses up ``locate.max_events``. Ones that find
        nothing are free up to ``max_events``; beyond that the localizer backs off (it skips 1, 3,
        7, ... steps after each further empty result: O(log steps) attempts), so a detector firing
        on noise neither runs the localizer on every step nor stops a later, real spike from
        being localized."""
        if found:
            self.events_localized += 1
            return
        self.events_unconfirmed += 1
        over = self.events_unconfirmed - self.locate_config.max_events
        if over >= 0:
            self._retry_step = step + 2 ** min(over, 30)
            self._warn_once("unconfirmed", f"{self.events_unconfirmed} detected spikes (the last at step {step}) "
                            "had no culprit token; further spikes without one are localized with growing gaps. "
                            "The detector fires on noise here: raise spikes.z_thresh or spikes.warmup_steps.")

    def _pack(self, grad_sq, w_sq, clip_result, lr, weight_decay, spike_context):
        """Everything to move to the host this step, as named device values in one pack."""
        pack = _Pack(grad_sq.device)
        layer_sq = self.grouping.sum_by_layer(grad_sq)  # (L,)
        layer_norm = layer_sq.sqrt()
        pack.add(["grad_norm/global"], grad_sq.sum().sqrt())
        pack.add(["grad_norm/nonfinite"], (~torch.isfinite(grad_sq)).sum())
        pack.add(self._layer_keys, layer_norm)
        # per-tensor norms always travel (n floats): GradStats.grad_norms then needs no 2nd sync
        pack.add(self._tensor_keys, grad_sq.sqrt())
        if w_sq is not None:
            w_layer = self.grouping.sum_by_layer(w_sq).sqrt()  # (L,)
            pack.add(self._weight_keys, torch.cat([w_sq.sum().sqrt().reshape(1), w_layer]))
            pack.add(self._ratio_keys, layer_norm / w_layer.clamp_min(1e-12))
        if clip_result is not None:
            from .clip.metrics import clip_metrics

            cm = clip_metrics(clip_result, self._clip_grouping)  # {key: 0-d device tensor}
            pack.add(list(cm), torch.stack([v.to(grad_sq.device, torch.float32).reshape(()) for v in cm.values()]))
        lr, weight_decay = self._lr_wd(lr, weight_decay)
        for key, val in ((_LR, lr), (_WD, weight_decay)):
            if isinstance(val, torch.Tensor):  # a tensor lr (capturable optimizers): ride along
                pack.add([key], val)
        n_tokens = n_micro = None
        if spike_context is not None:
            masks = spike_context.token_mask
            if not isinstance(masks, torch.Tensor):  # one mask per micro-batch (gradient accumulation)
                masks = list(masks)
                n_micro = len(masks)
            else:
                masks = [masks]
            if all(m.device == grad_sq.device for m in masks):
                pack.add([_N_TOKENS], torch.stack([m.sum() for m in masks]).sum())  # rides along in the one transfer
            else:  # host-side masks with device gradients: summing them on the host waits for nothing
                n_tokens = int(sum(float(m.sum()) for m in masks))
        return pack, lr, weight_decay, n_tokens, n_micro

    def _global_count(self, n: int) -> int:
        """The global batch's loss-token count (the fixed detector's ``T / sqrt(n)``): every rank
        must reach the same spike decision, since localizing is a collective."""
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size(self.process_group) > 1):
            return n
        t = torch.tensor([float(n)], device=self.params[0].device)
        dist.all_reduce(t, group=self.process_group)  # only on armed steps of the fixed detector
        return int(t.item())  # host sync: the detector needs the count now

    def _lr_wd(self, lr, weight_decay):
        """lr / weight_decay from the arguments, else from the optimizer's param groups."""
        groups = getattr(self.optimizer, "param_groups", None) or []
        if lr is None and groups:
            lr = groups[0].get("lr")
        if weight_decay is None and groups:
            adamc = getattr(self.optimizer, "adamc_weight_decay", None)
            if adamc is not None and adamc.corrected_groups:  # AdamC: the schedule-scaled groups' decay
                groups = [groups[i] for i in adamc.corrected_groups]
            decays = [g.get("weight_decay") for g in groups if g.get("weight_decay") is not None]
            if decays:  # no-decay groups (norms, biases) hold 0: the decayed groups' value is the one
                weight_decay = max(decays, key=float)
        return lr, weight_decay

    def _lr_metrics(self, lr: float | None, weight_decay: float | None) -> dict[str, float]:
        """``lr`` at the step it applies; ``weight_decay`` when it changes; AdamC's ratio where it means something."""
        out: dict[str, float] = {}
        if lr is not None:
            out["lr"] = float(lr)
        if weight_decay is not None and float(weight_decay) != getattr(self, "_last_wd", None):
            out["weight_decay"] = self._last_wd = float(weight_decay)
        adamc = self.config.adamc_ratio
        if adamc is None:  # auto: only when AdamC's schedule-scaled decay drives this optimizer
            adamc = getattr(self.optimizer, "adamc_weight_decay", None) is not None
        if adamc and lr is not None and weight_decay is not None and float(lr) > 0 and float(weight_decay) > 0:
            out["adamc/steady_state_ratio"] = math.sqrt(2.0 * float(weight_decay) / float(lr))
        return out

    def _localize(self, step: int, stats: GradStats, ctx: Any) -> dict[str, float]:
        """Run the localizer on the spiking batch and hand the result to the artifact writer."""
        cfg = self.locate_config
        if not cfg.enabled or self.events_localized >= cfg.max_events:
            return {}
        if step < self._retry_step:  # the detector keeps firing on batches without a culprit: back off
            return {}
        from .localizer import locate  # imported here: the localizer is only needed on a spike

        try:
            with torch.enable_grad():
                result = locate(self.model, ctx.loss_fn, ctx.token_mask, method=cfg.method, budget=cfg.budget,
                                threshold=cfg.threshold, group_by=self.config.group_by,
                                rng_state=getattr(ctx, "rng_state", None))
        except Exception as exc:  # forensics must never kill training
            warnings.warn(f"gradloc-track: localizing the spike at step {step} failed: {exc!r}")
            return {"locate/failed": 1.0}
        self._count_localization(step, bool(result.tokens))
        stats.locate = result
        shown, shown_ctx = result, ctx
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            from .localizer.dist_context import gather_culprit_rows  # a collective: culprit rows to rank 0

            try:
                shown, shown_ctx = gather_culprit_rows(result, ctx)
            except Exception as exc:  # building rank 0's view after the collective: local, never fatal
                warnings.warn(f"gradloc-track: gathering the culprits' text at step {step} failed: {exc!r}; "
                              "the artifacts show rank 0's own batch")
                shown, shown_ctx = (result, ctx) if self.rank == 0 else (None, None)
        stats.locate_view = (shown, shown_ctx) if shown is not None else None
        if self.artifact_writer is not None and self.rank == 0:
            try:
                self.artifact_writer.write(step, stats.events, shown, shown_ctx)
            except Exception as exc:
                warnings.warn(f"gradloc-track: writing spike artifacts at step {step} failed: {exc!r}")
        return {"locate/probes": float(result.probes), "locate/culprits": float(len(result.tokens)),
                "locate/threshold": float(result.threshold), "locate/seconds": float(result.wall_time_s)}
