"""Shared machinery of the clippers: the result type, non-finite handling, fused scaling.

Every clipper keeps its state (thresholds, EMAs) on the gradients' device and decides with
``torch.where``/``clamp``, so ``clip()`` never syncs to the host (``on_nonfinite="raise"`` is the
one exception: raising needs to know).

Memory traffic (what norms and clipping cost on an accelerator; ``gradloc_track.traffic``): given
the norms (the monitor's pass), ``clip()`` makes ONE fused read+write pass over the gradients, the
scaling. A non-finite step costs nothing more when the optimizer really skips it
(``SkipStepGuard``, which ``GradMonitor(optimizer=...)``, ``watch()`` and the callbacks install):
its gradients are never used, so they are not touched. Only where no guard makes the skip real,
and with ``on_nonfinite="zero"``, a second pass zeroes the non-finite values (integer views:
``NaN * 0`` is NaN in floating point).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import warnings

import torch

from ..config._validate import one_of
from ..norms import global_sq_norms, trainable_params

NONFINITE_MODES = ("skip", "zero", "raise")


@dataclass
class ClipResult:
    """What one ``clip()`` did. Tensors stay on device; the mapping/float views sync lazily."""

    names: list[str]
    threshold_t: torch.Tensor  # (n,) per-tensor threshold applied (global clippers: the global one)
    coef_t: torch.Tensor  # (n,) per-tensor multiplier applied
    pre_sq_t: torch.Tensor  # (n,) squared norms before clipping
    total_norm_pre_t: torch.Tensor  # () global norm before clipping
    total_norm_post_t: torch.Tensor  # () global norm after clipping
    nonfinite_t: torch.Tensor  # () bool: a non-finite gradient was seen this step
    kind: str = "none"

    @property
    def thresholds(self) -> dict[str, float]:
        return dict(zip(self.names, self.threshold_t.tolist()))  # host sync

    @property
    def coefs(self) -> dict[str, float]:
        return dict(zip(self.names, self.coef_t.tolist()))  # host sync

    @property
    def total_norm(self) -> float:
        return float(self.total_norm_pre_t)  # host sync

    @property
    def total_norm_post(self) -> float:
        return float(self.total_norm_post_t)  # host sync

    @property
    def nonfinite(self) -> bool:
        return bool(self.nonfinite_t)  # host sync


class Clipper:
    """Base: holds the parameters (in ``trainable_params`` order) and the non-finite policy.

    Subclasses implement ``_coefs(norms, finite) -> (thresholds, coefs)`` on device tensors and
    ``_update(...)`` for their running state; ``clip()`` does the rest. ``coefs`` may be 0-d
    (one coefficient for every tensor: applied with a single fused multiply) or ``(n,)``.
    ``self.present`` (``(n,)`` bool, device) says which parameters have a gradient this step.
    """

    kind = "none"
    scales = True  # False: coefficients are always 1 (NoClip), no scale pass

    def __init__(self, model: torch.nn.Module, on_nonfinite: str = "skip", process_group: Any = None) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"{type(self).__name__}(model=...) needs a torch.nn.Module, got {type(model).__name__}")
        one_of("on_nonfinite", on_nonfinite, NONFINITE_MODES)
        named = trainable_params(model)
        if not named:
            raise ValueError(f"{type(self).__name__}: the model has no parameters with requires_grad=True")
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.on_nonfinite = on_nonfinite
        self.process_group = process_group
        self.steps = 0  # python int: warm-up bookkeeping needs no device value
        self.last_nonfinite: torch.Tensor | None = None  # () bool of the last clip(), for SkipStepGuard
        self.last_nonfinite_host: bool | None = None  # the same, when a caller already has it on the host
        # set by a SkipStepGuard: the optimizer skips a non-finite step for real, so its gradients
        # need no zeroing (one pass less); a fused guard also gets ``~all_finite`` written into
        # ``found_inf`` (the optimizer's own skip flag) by every clip()
        self.skip_exact = False
        self.found_inf: torch.Tensor | None = None
        self._warned_skip = False
        self._present_key: tuple[bool, ...] | None = None
        self._present_t: torch.Tensor | None = None

    def _present(self, grads: list[torch.Tensor | None], device: torch.device) -> torch.Tensor:
        """(n,) bool: which tensors have a gradient. Cached: a host->device copy only when it changes."""
        key = tuple(g is not None for g in grads)
        if key != self._present_key or self._present_t is None or self._present_t.device != device:
            self._present_key = key
            self._present_t = torch.tensor(key, dtype=torch.bool, device=device)
        return self._present_t

    def _sq_norms(self, grads: list[torch.Tensor | None]) -> torch.Tensor:
        return global_sq_norms(grads, self.process_group)  # (n,) device

    @torch.no_grad()
    def clip(self, sq_norms: torch.Tensor | None = None) -> ClipResult:
        """Clip every ``p.grad`` in place. ``sq_norms``: per-tensor squared norms if already known."""
        grads = [p.grad for p in self.params]
        if sq_norms is None:
            sq_norms = self._sq_norms(grads)  # (n,) device
        sq_norms = sq_norms.float()
        self.present = self._present(grads, sq_norms.device)
        norms = sq_norms.sqrt()  # (n,)
        finite_t = torch.isfinite(norms)  # (n,) per tensor
        all_finite = finite_t.all()
        if self.on_nonfinite == "raise" and not bool(all_finite):  # host sync: the error path needs it
            bad = [n for n, ok in zip(self.names, finite_t.tolist()) if not ok]
            raise FloatingPointError(f"non-finite gradient in {bad[:10]}{' ...' if len(bad) > 10 else ''}; "
                                     "set on_nonfinite='skip' or 'zero' to keep training")
        safe = torch.where(finite_t, norms, torch.zeros_like(norms))  # (n,) never NaN downstream
        total_pre = sq_norms.sum().sqrt()
        thresholds, coefs = self._coefs(safe, all_finite)
        if self.on_nonfinite == "skip":  # zero everything: the optimizer step becomes a no-op
            keep = all_finite  # ()
            coefs = torch.where(keep, coefs, torch.zeros_like(coefs))
        else:  # zero only the non-finite tensors
            keep = finite_t  # (n,)
            coefs = torch.where(keep, coefs, torch.zeros_like(keep, dtype=coefs.dtype))
        # skip: a step with any non-finite gradient teaches the running state nothing
        update_ok = finite_t & all_finite if self.on_nonfinite == "skip" else finite_t
        self._update(safe, thresholds, coefs, update_ok, all_finite)
        self.steps += 1
        zero = self._zero_mask(keep)
        if self.scales or zero is not None:  # NoClip with a guard: no pass over the gradients at all
            scale_grads(grads, coefs if self.scales else None, zero)
        coef_n = coefs.expand_as(norms) if coefs.dim() == 0 else coefs  # (n,)
        post = torch.where(finite_t, safe * coef_n, torch.zeros_like(safe))
        self.last_nonfinite, self.last_nonfinite_host = ~all_finite, None
        if self.found_inf is not None:  # a fused optimizer's skip flag (SkipStepGuard mode="fused")
            self.found_inf.copy_(self.last_nonfinite)
        return ClipResult(self.names, thresholds.expand_as(norms), coef_n, sq_norms, total_pre,
                          post.pow(2).sum().sqrt(), ~all_finite, self.kind)

    def _zero_mask(self, keep: torch.Tensor) -> torch.Tensor | None:
        """Which gradients must be zeroed in place (None: none, the scale pass alone).

        raise: every gradient is finite (else it raised); skip with a guard: the optimizer never
        uses a non-finite step's gradients. Otherwise zero them, and say once that zeroing is not
        skipping for optimizers that move without a gradient."""
        if self.on_nonfinite == "raise" or (self.on_nonfinite == "skip" and self.skip_exact):
            return None
        if self.on_nonfinite == "skip" and not self._warned_skip:
            self._warned_skip = True
            warnings.warn(f"gradloc-track: {type(self).__name__}(on_nonfinite='skip') does not know the optimizer, so "
                          "a non-finite step only zeroes the gradients: AdamW (moments, weight decay) and momentum "
                          "SGD still move the weights. Make the skip exact with gradloc_track.clip.SkipStepGuard("
                          "optimizer, clipper), or pass optimizer= to GradMonitor (watch() and the HF/Lightning "
                          "callbacks do it for you).", UserWarning, stacklevel=3)
        return keep

    # -- to implement --------------------------------------------------------------------
    def _coefs(self, norms: torch.Tensor, finite: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inf = torch.full_like(norms, float("inf"))
        return inf, torch.ones((), device=norms.device)

    def _update(self, norms, thresholds, coefs, finite_t, all_finite) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = int(state["steps"])


# float dtype -> same-width integer dtype: multiplying the bit pattern by 0/1 zeroes or keeps a
# tensor exactly, NaN and Inf included (NaN * 0 is NaN in floating point, 0 in integers)
_BITS = {torch.float32: torch.int32, torch.float64: torch.int64, torch.bfloat16: torch.int16,
         torch.float16: torch.int16}


def _scalable(g: torch.Tensor) -> torch.Tensor:
    """The dense storage to scale in place: a DTensor's local shard, a sparse COO tensor's values."""
    g = g.to_local() if hasattr(g, "to_local") else g
    return g._values() if g.layout == torch.sparse_coo else g


def scale_grads(grads: list[torch.Tensor | None], coefs: torch.Tensor | None, keep: torch.Tensor | None) -> None:
    """``g_i <- keep_i ? coef_i * g_i : 0`` for every gradient, with fused kernels, no host sync.

    ``coefs``: 0-d (one fp32 multiplier for all) or ``(n,)``, or None (zero only); ``keep``: 0-d or ``(n,)`` bool, or
    None when no gradient needs zeroing (all finite, or the step is skipped anyway). One
    ``_foreach_mul_`` per (device, dtype) group applies the fp32 coefficient to each tensor in its
    own dtype (computed in fp32, rounded once). Zeroing multiplies each tensor's integer view by
    0/1 (so NaN/Inf become exact zeros, which no floating-point op does) in one more fused call:
    no per-tensor kernels.
    """
    idx_all = [i for i, g in enumerate(grads) if g is not None]
    if not idx_all:
        return
    ts_all = [grads[i] for i in idx_all]
    groups = _plain_groups(idx_all, ts_all)
    if groups is None:  # DTensor / sparse gradients: group their local dense storage
        groups = defaultdict(lambda: ([], []))
        for i, g in zip(idx_all, ts_all):
            t = _scalable(g)
            idx, ts = groups[(t.device, t.dtype)]
            idx.append(i)
            ts.append(t)
    n = len(grads)
    for (dev, dtype), (idx, ts) in groups.items():
        if keep is not None:
            _zero_group(ts, keep if keep.dim() == 0 else _take(keep, idx, n, dev), dev, dtype)
        if coefs is not None:
            scale_dtype = torch.float64 if dtype == torch.float64 else torch.float32
            if coefs.dim() == 0:
                torch._foreach_mul_(ts, coefs.to(device=dev, dtype=scale_dtype))
            else:
                torch._foreach_mul_(ts, list(_take(coefs, idx, n, dev).to(scale_dtype).unbind()))


def _zero_group(ts: list[torch.Tensor], keep: torch.Tensor, dev: torch.device, dtype: torch.dtype) -> None:
    """Zero the tensors of one (device, dtype) group where ``keep`` (0-d or one per tensor) is False."""
    bits = _BITS.get(dtype)
    if bits is None:  # exotic dtype: per-tensor clean-up
        for t in ts:
            torch.nan_to_num_(t, nan=0.0, posinf=0.0, neginf=0.0)
        return
    views = [t.view(bits) for t in ts]
    if keep.dim() == 0:
        torch._foreach_mul_(views, keep.to(device=dev, dtype=bits))
    else:
        torch._foreach_mul_(views, list(keep.to(bits).unbind()))


def _plain_groups(idx_all: list[int], ts_all: list[torch.Tensor]) -> dict | None:
    """(device, dtype) -> (indices, tensors), grouped in C++ (no per-tensor attribute reads in
    Python); None when a tensor is not a plain strided one (checked by exact type and layout)."""
    if any(type(t) is not torch.Tensor for t in ts_all) or any(t.is_sparse for t in ts_all):
        return None
    grouped = torch._C._group_tensors_by_device_and_dtype([ts_all], True)
    return {key: ([idx_all[j] for j in pos], tensors[0]) for key, (tensors, pos) in grouped.items()}


def _take(values: torch.Tensor, idx: list[int], n: int, device: torch.device) -> torch.Tensor:
    if len(idx) == n:  # every tensor in one group, in order
        return values.to(device)
    return values[torch.tensor(idx, device=values.device)].to(device)
