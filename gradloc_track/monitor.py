"""GradMonitor: per-layer gradient observability, called after ``backward()``.

One fused pass computes every per-tensor squared norm (gradients and weights); everything that
is logged is stacked into ONE device tensor and moved to the host once per logging step. Steps
that do not log do no host sync (unless a spike detector is armed with a batch to localize,
see ``after_backward``).
"""
from __future__ import annotations

import logging
import math
import warnings
from dataclasses import fields
from typing import Any, Mapping

import torch
import torch.distributed as dist

from .config import LocateConfig, MonitorConfig
from .grouping import LayerGrouping
from .norms import all_reduce_sq_norms, sq_norms, trainable_params
from .trackers.base import NullTracker, Tracker

log = logging.getLogger(__name__)


class GradStats:
    """What one ``after_backward`` call saw. Float views are computed lazily from device tensors.

    Reading a float property on a step that did not log is a host sync; on logging steps the
    values are already on the host.
    """

    def __init__(self, step: int, names: list[str], grouping: LayerGrouping, grad_sq: torch.Tensor,
                 layer_sq: torch.Tensor, logged: bool, host: dict[str, float] | None = None) -> None:
        self.step = step
        self.logged = logged
        self._names = names
        self._grouping = grouping
        self._grad_sq = grad_sq  # (n_tensors,) device
        self._layer_sq = layer_sq  # (n_layers,) device
        self._host = host
        self.metrics: dict[str, float] = host or {}
        self.clip = None  # ClipResult when a clipper ran
        self.events: list = []  # SpikeEvents fired this step
        self.locate = None  # LocateResult when a spike was localized

    @property
    def grad_norms(self) -> dict[str, float]:
        """parameter name -> L2 norm of its gradient (before clipping)."""
        vals = self._grad_sq.sqrt().tolist()  # host sync, only when the caller asks for it
        return dict(zip(self._names, vals))

    @property
    def layer_norms(self) -> dict[str, float]:
        vals = self._layer_sq.sqrt().tolist()  # host sync
        return dict(zip(self._grouping.layers, vals))

    @property
    def global_norm(self) -> float:
        if self._host is not None and "grad_norm/global" in self._host:
            return self._host["grad_norm/global"]
        return float(self._grad_sq.sum().sqrt())  # host sync


class GradMonitor:
    """Logs gradient health after ``loss.backward()`` and before ``optimizer.step()``.

    ```python
    monitor = GradMonitor(model, tracker=tracker, clipper=clipper, log_every=10)
    loss.backward()
    stats = monitor.after_backward(step)   # norms, clipping, spike detection, localization
    optimizer.step()
    ```

    Metric keys (``<layer>`` per ``group_by``: block -> ``h.3``, module -> ``h.3.attn.qkv``,
    tensor -> the parameter name):

    - ``grad_norm/global``: L2 norm of all gradients (before clipping)
    - ``grad_norm/<layer>``: L2 norm of the layer's gradients
    - ``grad_norm/tensor/<param>``: per-tensor norms (``per_tensor=True``)
    - ``grad_norm/nonfinite``: number of tensors whose gradient has a NaN/Inf
    - ``weight_norm/global``, ``weight_norm/<layer>``: parameter norms (``weight_norms=True``)
    - ``grad_weight_ratio/<layer>``: ``||g|| / ||w||`` of the layer (``weight_norms=True``)
    - ``lr``, ``weight_decay``: when known (argument or ``optimizer.param_groups[0]``)
    - ``adamc/steady_state_ratio``: ``sqrt(2 * wd / lr)``, the ratio ``||g||/||w||`` that
      decoupled weight decay drives normalized layers to (Defazio, arXiv 2506.02285); a
      ``grad_weight_ratio`` tracking it as ``lr -> 0`` is schedule-driven norm growth, not a spike
    - ``clip/...``: from the clipper (``clip/threshold/<layer>``, ``clip/coef/<layer>``,
      ``clip/clipped_fraction``, ``clip/total_norm_pre``, ``clip/total_norm_post``)
    - ``spike/...``: from the detector; ``locate/probes``, ``locate/culprits``,
      ``locate/threshold``, ``locate/seconds`` when a spike was localized
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
            raise TypeError("pass either config=MonitorConfig(...) or option keywords, not both")
        self.config = config
        self.model = model
        self.optimizer = optimizer
        self.process_group = process_group
        self.clipper = clipper
        self.detector = detector
        self.locate_config = locate_config or LocateConfig()
        self.artifact_writer = artifact_writer
        self.rank = dist.get_rank(process_group) if dist.is_available() and dist.is_initialized() else 0
        # only rank 0 logs; the others get the do-nothing tracker (no branching at call sites)
        self.tracker: Tracker = (tracker or NullTracker()) if self.rank == 0 else NullTracker()
        named = trainable_params(model)
        if not named:
            raise ValueError("GradMonitor: the model has no parameters with requires_grad=True")
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.grouping = LayerGrouping.build(self.names, config.group_by, config.groups or None)
        self._layer_keys = [f"grad_norm/{lay}" for lay in self.grouping.layers]
        self.events_localized = 0

    # -- public --------------------------------------------------------------------------
    def should_log(self, step: int) -> bool:
        return step % self.config.log_every == 0

    @torch.no_grad()
    def after_backward(self, step: int, *, lr: float | None = None, weight_decay: float | None = None,
                       spike_context: Any = None) -> GradStats:
        """Compute norms, clip, detect and localize spikes, and log. Returns ``GradStats``.

        Host syncs: one on logging steps; on other steps none, except when a detector AND a
        ``spike_context`` are given (one small transfer, so a spike on any step can be localized).
        """
        grads = [p.grad for p in self.params]
        grad_sq = all_reduce_sq_norms(sq_norms(grads), grads, self.process_group)  # (n,) device
        clip_result = self.clipper.clip(grad_sq) if self.clipper is not None else None
        log_now = self.should_log(step)
        armed = self.detector is not None and spike_context is not None
        layer_sq = self.grouping.sum_by_layer(grad_sq)  # (L,) device
        if not (log_now or armed):
            stats = GradStats(step, self.names, self.grouping, grad_sq, layer_sq, logged=False)
            stats.clip = clip_result
            return stats

        keys, vals = self._device_metrics(grad_sq, layer_sq, clip_result, with_weights=log_now)
        host_vals = torch.stack(vals).tolist()  # THE host sync of this step
        host = dict(zip(keys, host_vals))
        host.update(self._lr_metrics(lr, weight_decay))
        stats = GradStats(step, self.names, self.grouping, grad_sq, layer_sq, logged=log_now, host=host)
        stats.clip = clip_result

        if self.detector is not None:
            layer_norms = {lay: host[k] for lay, k in zip(self.grouping.layers, self._layer_keys)}
            n_tokens = None
            if spike_context is not None and getattr(self.detector.config, "mode", "") == "fixed":
                n_tokens = int(spike_context.token_mask.sum())  # host sync: GradLoc's knob needs it
            stats.events = list(self.detector.update(step, host["grad_norm/global"], layer_norms,
                                                     n_tokens=n_tokens))
            host.update(self.detector.metrics())
            if stats.events and spike_context is not None:
                host.update(self._localize(step, stats, spike_context))
        if log_now or stats.events:
            self.tracker.log_metrics(host, step)
        return stats

    # -- internals -----------------------------------------------------------------------
    def _device_metrics(self, grad_sq, layer_sq, clip_result, with_weights: bool):
        """Names and 0-d device tensors of everything to log, for one stacked transfer."""
        keys = ["grad_norm/global", "grad_norm/nonfinite"]
        vals = [grad_sq.sum().sqrt(), (~torch.isfinite(grad_sq)).sum().to(grad_sq.dtype)]
        layer_norm = layer_sq.sqrt()
        keys += self._layer_keys
        vals += list(layer_norm.unbind())
        if self.config.per_tensor:
            keys += [f"grad_norm/tensor/{n}" for n in self.names]
            vals += list(grad_sq.sqrt().unbind())
        if with_weights and self.config.weight_norms:
            w_sq = all_reduce_sq_norms(sq_norms([p.detach() for p in self.params]), self.params,
                                       self.process_group)
            w_layer = self.grouping.sum_by_layer(w_sq).sqrt()
            keys.append("weight_norm/global")
            vals.append(w_sq.sum().sqrt())
            keys += [f"weight_norm/{lay}" for lay in self.grouping.layers]
            vals += list(w_layer.unbind())
            keys += [f"grad_weight_ratio/{lay}" for lay in self.grouping.layers]
            vals += list((layer_norm / w_layer.clamp_min(1e-12)).unbind())
        if clip_result is not None:
            from .clip.metrics import clip_metrics

            for k, v in clip_metrics(clip_result, self.grouping).items():
                keys.append(k)
                vals.append(v.to(grad_sq.device, torch.float32).reshape(()))
        return keys, [v.to(torch.float32) for v in vals]

    def _lr_metrics(self, lr: float | None, weight_decay: float | None) -> dict[str, float]:
        if self.optimizer is not None and self.optimizer.param_groups:
            group = self.optimizer.param_groups[0]
            lr = float(group.get("lr", lr)) if lr is None else lr  # python floats: no sync
            if weight_decay is None:
                weight_decay = max(float(g.get("weight_decay", 0.0)) for g in self.optimizer.param_groups)
        out: dict[str, float] = {}
        if lr is not None:
            out["lr"] = float(lr)
        if weight_decay is not None:
            out["weight_decay"] = float(weight_decay)
        if lr and weight_decay:
            out["adamc/steady_state_ratio"] = math.sqrt(2.0 * weight_decay / lr)
        return out

    def _localize(self, step: int, stats: GradStats, ctx: Any) -> dict[str, float]:
        """Run the localizer on the spiking batch and hand the result to the artifact writer."""
        cfg = self.locate_config
        if not cfg.enabled or self.events_localized >= cfg.max_events:
            return {}
        from .locate import locate

        try:
            with torch.enable_grad():
                result = locate(self.model, ctx.loss_fn, ctx.token_mask, method=cfg.method,
                                budget=cfg.budget, threshold=cfg.threshold, group_by=self.config.group_by,
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
