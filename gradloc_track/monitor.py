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
      group 0, the largest ``weight_decay`` of any group, since no-decay groups hold 0)
    - ``adamc/steady_state_ratio``: ``sqrt(2 * weight_decay / lr)``, the ratio ``||g||/||w||``
      that decoupled weight decay drives normalized layers to (Defazio, arXiv 2506.02285); a
      ``grad_weight_ratio`` tracking it as ``lr -> 0`` is schedule-driven norm growth, not a spike
    - ``clip/threshold/<layer>`` (or ``clip/threshold/global``), ``clip/coef/<layer>``,
      ``clip/clipped_fraction``, ``clip/total_norm_pre``, ``clip/total_norm_post``,
      ``clip/nonfinite``: from the clipper (see ``gradloc_track.clip.metrics``)
    - ``spike/...``: from the detector's ``metrics()``
    - ``locate/probes``, ``locate/culprits``, ``locate/threshold``, ``locate/seconds`` when a
      spike was localized; ``locate/failed`` when localizing raised (a warning, never a crash)

    Only global rank 0 logs (other ranks get a ``NullTracker``). A spike on a non-logging step
    is logged at its own step (its norms, spike and locate keys).
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
        self.config = config
        self.model = model
        self.optimizer = optimizer
        self.process_group = process_group
        self.clipper = clipper
        self.detector = detector
        self.locate_config = locate_config or LocateConfig()
        self.artifact_writer = artifact_writer
        self.rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        # only rank 0 logs; the others get the do-nothing tracker (no branching at call sites)
        self.tracker: Tracker = (tracker or NullTracker()) if self.rank == 0 else NullTracker()
        named = trainable_params(model)
        if not named:
            raise ValueError("GradMonitor: the model has no parameters with requires_grad=True")
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.grouping = LayerGrouping.build(self.names, config.group_by, config.groups or None)
        layers = self.grouping.layers
        clash = RESERVED_LAYER_NAMES.intersection(layers)
        if clash:
            raise ValueError(f"GradMonitor: layer name(s) {sorted(clash)} would clash with grad_norm/global or "
                             "grad_norm/nonfinite; rename them with monitor.groups={name: regex}")
        self._layer_keys = [f"grad_norm/{lay}" for lay in layers]
        self._tensor_keys = [f"grad_norm/tensor/{n}" for n in self.names]
        self._weight_keys = ["weight_norm/global"] + [f"weight_norm/{lay}" for lay in layers]
        self._ratio_keys = [f"grad_weight_ratio/{lay}" for lay in layers]
        self.events_localized = 0

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
        weight norms share it).
        """
        log_now = self.should_log(step)
        armed = self.detector is not None and spike_context is not None
        with_weights = log_now and self.config.weight_norms
        grad_sq, w_sq = self._global_sq_norms(with_weights)  # (n,), (n,)|None device
        clip_result = self.clipper.clip(grad_sq) if self.clipper is not None else None
        if not (log_now or armed):  # nothing leaves the device
            return GradStats(step, self.grouping, grad_sq, logged=False, clip=clip_result)

        pack, lr, weight_decay, n_tokens = self._pack(grad_sq, w_sq, clip_result, lr, weight_decay,
                                                      spike_context if armed else None)
        host = pack.to_host()
        tensor_vals = [host[k] for k in self._tensor_keys]
        layer_vals = [host[k] for k in self._layer_keys]
        lr = host.pop(_LR, lr)
        weight_decay = host.pop(_WD, weight_decay)
        if _N_TOKENS in host:
            n_tokens = int(host.pop(_N_TOKENS))
        metrics = {k: v for k, v in host.items() if self.config.per_tensor or not k.startswith("grad_norm/tensor/")}
        metrics.update(self._lr_metrics(lr, weight_decay))
        stats = GradStats(step, self.grouping, grad_sq, logged=log_now, metrics=metrics, clip=clip_result,
                          host={"global": host["grad_norm/global"], "tensor": tensor_vals, "layer": layer_vals})

        if self.detector is not None:
            stats.events = list(self.detector.update(step, host["grad_norm/global"], stats.layer_norms,
                                                     n_tokens=n_tokens))
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

            cm = clip_metrics(clip_result, self.grouping)  # {key: 0-d device tensor}
            pack.add(list(cm), torch.stack([v.to(grad_sq.device, torch.float32).reshape(()) for v in cm.values()]))
        lr, weight_decay = self._lr_wd(lr, weight_decay)
        for key, val in ((_LR, lr), (_WD, weight_decay)):
            if isinstance(val, torch.Tensor):  # a tensor lr (capturable optimizers): ride along
                pack.add([key], val)
        n_tokens = None
        if spike_context is not None:
            mask = spike_context.token_mask
            if not isinstance(mask, torch.Tensor):  # K micro-batch masks: their summed count
                mask = torch.stack([m.sum() for m in mask])
            if mask.device == grad_sq.device:
                pack.add([_N_TOKENS], mask.sum())  # rides along in the one transfer
            else:  # a host-side mask with device gradients: summing it on the host waits for nothing
                n_tokens = int(mask.sum())
        return pack, lr, weight_decay, n_tokens

    def _lr_wd(self, lr, weight_decay):
        """lr / weight_decay from the arguments, else from the optimizer's param groups."""
        groups = getattr(self.optimizer, "param_groups", None) or []
        if lr is None and groups:
            lr = groups[0].get("lr")
        if weight_decay is None and groups:
            decays = [g.get("weight_decay") for g in groups if g.get("weight_decay") is not None]
            if decays:  # no-decay groups (norms, biases) hold 0: the decayed groups' value is the one
                weight_decay = max(decays, key=float)
        return lr, weight_decay

    @staticmethod
    def _lr_metrics(lr: float | None, weight_decay: float | None) -> dict[str, float]:
        out: dict[str, float] = {}
        if lr is not None:
            out["lr"] = float(lr)
        if weight_decay is not None:
            out["weight_decay"] = float(weight_decay)
        if lr is not None and weight_decay is not None and float(lr) > 0 and float(weight_decay) > 0:
            out["adamc/steady_state_ratio"] = math.sqrt(2.0 * float(weight_decay) / float(lr))
        return out

    def _localize(self, step: int, stats: GradStats, ctx: Any) -> dict[str, float]:
        """Run the localizer on the spiking batch and hand the result to the artifact writer."""
        cfg = self.locate_config
        if not cfg.enabled or self.events_localized >= cfg.max_events:
            return {}
        from .locate import locate  # imported here: the localizer is only needed on a spike

        try:
            with torch.enable_grad():
                result = locate(self.model, ctx.loss_fn, ctx.token_mask, method=cfg.method, budget=cfg.budget,
                                threshold=cfg.threshold, group_by=self.config.group_by,
                                rng_state=getattr(ctx, "rng_state", None))
        except Exception as exc:  # forensics must never kill training
            warnings.warn(f"gradloc-track: localizing the spike at step {step} failed: {exc!r}")
            return {"locate/failed": 1.0}
        self.events_localized += 1
        stats.locate = result
        if self.artifact_writer is not None and self.rank == 0:
            try:
                self.artifact_writer.write(step, stats.events, result, ctx)
            except Exception as exc:
                warnings.warn(f"gradloc-track: writing spike artifacts at step {step} failed: {exc!r}")
        return {"locate/probes": float(result.probes), "locate/culprits": float(len(result.tokens)),
                "locate/threshold": float(result.threshold), "locate/seconds": float(result.wall_time_s)}
