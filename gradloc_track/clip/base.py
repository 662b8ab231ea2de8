"""Shared machinery of the clippers: the result type, non-finite handling, fused scaling.

Every clipper keeps its state (thresholds, EMAs) on the gradients' device and decides with
``torch.where``/``clamp``, so ``clip()`` never syncs to the host (``on_nonfinite="raise"`` is the
one exception: raising needs to know).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..config._validate import check, one_of
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
    ``_update(...)`` for their running state; ``clip()`` does the rest.
    """

    kind = "none"

    def __init__(self, model: torch.nn.Module, on_nonfinite: str = "skip", process_group: Any = None) -> None:
        one_of("on_nonfinite", on_nonfinite, NONFINITE_MODES)
        named = trainable_params(model)
        if not named:
            raise ValueError(f"{type(self).__name__}: the model has no parameters with requires_grad=True")
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.on_nonfinite = on_nonfinite
        self.process_group = process_group
        self.steps = 0  # python int: warm-up bookkeeping needs no device value

    @torch.no_grad()
    def clip(self, sq_norms: torch.Tensor | None = None) -> ClipResult:
        """Clip every ``p.grad`` in place. ``sq_norms``: per-tensor squared norms if already known."""
        grads = [p.grad for p in self.params]
        if sq_norms is None:
            sq_norms = global_sq_norms(grads, self.process_group)  # (n,) device
        sq_norms = sq_norms.float()
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
            coefs = torch.where(all_finite, coefs, torch.zeros_like(coefs))
        else:  # zero only the non-finite tensors
            coefs = torch.where(finite_t, coefs, torch.zeros_like(coefs))
        # skip: a step with any non-finite gradient teaches the running state nothing
        update_ok = finite_t & all_finite if self.on_nonfinite == "skip" else finite_t
        self._update(safe, thresholds, coefs, update_ok, all_finite)
        self.steps += 1
        self._scale(grads, coefs)
        post = torch.where(finite_t, safe * coefs, torch.zeros_like(safe))
        return ClipResult(self.names, thresholds, coefs, sq_norms, total_pre, post.pow(2).sum().sqrt(),
                          ~all_finite, self.kind)

    @staticmethod
    def _scale(grads: list[torch.Tensor | None], coefs: torch.Tensor) -> None:
        """g_i *= coef_i for every tensor, with fused kernels (one per device/dtype group)."""
        idx = [i for i, g in enumerate(grads) if g is not None]
        if not idx:
            return
        gs = [grads[i] for i in idx]
        locals_ = [g.to_local() if hasattr(g, "to_local") else g for g in gs]
        scales = coefs[torch.tensor(idx, device=coefs.device)].to(locals_[0].dtype)  # (k,)
        torch._foreach_mul_(locals_, list(scales.unbind()))
        # a non-finite tensor always has coef 0, but NaN * 0 is NaN: a second fused-cost pass
        # turns those into zeros without asking the host which tensors they were
        for t in locals_:
            torch.nan_to_num_(t, nan=0.0, posinf=0.0, neginf=0.0)

    # -- to implement --------------------------------------------------------------------
    def _coefs(self, norms: torch.Tensor, finite: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inf = torch.full_like(norms, float("inf"))
        return inf, torch.ones_like(norms)

    def _update(self, norms, thresholds, coefs, finite_t, all_finite) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps = int(state["steps"])


def positive(name: str, value: float, example: str) -> None:
    check(value > 0, name, value, f"use a positive value (e.g. {example})")


def in_unit_interval(name: str, value: float) -> None:
    check(0.0 < value < 1.0, name, value, "use a value strictly between 0 and 1")
