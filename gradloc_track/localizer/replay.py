"""Do the probes reproduce the step? Their sum against the gradient the step's backward left.

Every probe replays its micro-batch's RNG state, so dropout masks repeat; when the states are the
ones saved right before each micro-batch's training forward, the sum of the K full-mask probes
IS the step's gradient (``.grad`` before localizing). That is checked once, at no probe's cost,
tensor by tensor with the best scale per tensor (a clipper that rescaled ``.grad`` in place is
not a difference; dropout replayed from the wrong state, a stateful module or another loss are).
When it fails, one more forward pass tells randomness the RNG cannot replay from the rest, and
the result says why (``StepCheck.reason``, a warning, a note in the artifacts).
"""
from __future__ import annotations

import math
import warnings

import torch

from .probe import Grads, Prober, restore_rng
from .result import StepCheck

HALF = (torch.float16, torch.bfloat16)


def step_check(prober: Prober, total: Grads, reference: list[torch.Tensor | None] | None) -> StepCheck | None:
    """Compare ``total`` (the probes' sum) with ``reference`` (the step's ``.grad``); None when
    the step left no gradient to compare with."""
    if reference is None or all(r is None for r in reference):
        return None
    residual, ratio = _compare(total, reference)
    if ratio == 0:
        return None  # zeroed gradients (zero_grad(set_to_none=False)): nothing to compare with
    tol = 3e-2 if any(t.dtype in HALF for t in total) else 1e-3
    if residual <= tol:
        return StepCheck(residual, ratio, True)
    return StepCheck(residual, ratio, False, _why(prober))


def _compare(total: Grads, reference: list[torch.Tensor | None]) -> tuple[float, float]:
    """(relative residual, ||reference|| / ||total||). The residual is ``||total - ref|| / ||total||``
    when that is already small (no rescaling), else the one left after the best scale per tensor.
    Differences are formed elementwise (no cancellation in the norms); one tensor-sized temporary
    at a time."""
    pairs = [(t.detach(), _dense_like(r, t)) for t, r in zip(total, reference)]
    t_sq = sum(_sq(t) for t, _ in pairs)
    r_sq = sum(_sq(r) for _, r in pairs)
    if t_sq == 0:
        return (0.0 if r_sq == 0 else math.inf), (1.0 if r_sq == 0 else math.inf)
    ratio = math.sqrt(r_sq / t_sq)
    raw = math.sqrt(sum(_sq(t - r) for t, r in pairs) / t_sq)
    if raw <= 1e-3:
        return raw, ratio
    left = 0.0
    for t, r in pairs:
        rr = _sq(r)
        scale = Prober.dot([t], [r]) / rr if rr > 0 else 0.0
        left += _sq(t - scale * r)
    return math.sqrt(left / t_sq), ratio


def _dense_like(r: torch.Tensor | None, t: torch.Tensor) -> torch.Tensor:
    if r is None:
        return torch.zeros_like(t)
    r = r.detach().to(t.device)
    return (r.to_dense() if r.is_sparse else r).to(t.dtype)


def _sq(x: torch.Tensor) -> float:
    """Squared norm in float64 (half precision upcast one tensor at a time)."""
    x = x if x.dtype in (torch.float32, torch.float64) else x.float()
    return float(torch.linalg.vector_norm(x)) ** 2  # host sync per tensor: once per localization


def _why(prober: Prober) -> str:
    i = next((j for j in range(prober.k) if (prober.masks[j] != 0).any()), 0)
    with torch.no_grad():
        vals = []
        for _ in range(2):
            restore_rng(prober.rng_states[i])
            vals.append(prober.loss_fns[i](prober.masks[i]).detach())
    if not torch.equal(vals[0], vals[1]):
        return ("randomness that restoring the CPU/CUDA RNG state does not replay: two identical probes differ (a "
                "private torch.Generator, Python/NumPy random, a non-deterministic kernel)")
    return ("the probes are repeatable but do not add up to the step's gradient: the step ran with other "
            "randomness (pass the RNG state saved right before EACH micro-batch's forward, rng_state=[...]), the "
            "model changed since backward (a stateful module, train/eval mode, an optimizer step), or loss_fn is "
            "not the training loss")


def report(check: StepCheck | None, notes: list[str]) -> None:
    """A warning and a note when the probes do not reproduce the step; a note when ``.grad`` is a
    rescaled copy of it (clipped in place, or normalised differently from ``loss_fn``)."""
    if check is None:
        return
    if not check.replayed:
        text = (f"the localizer's probes do not reproduce the step's gradient (residual {check.residual:.2g} of "
                f"its norm): {check.reason}; the culprits describe the replayed step")
        warnings.warn(f"gradloc-track: {text}", UserWarning, stacklevel=4)
        notes.append(text)
    elif abs(check.norm_ratio - 1.0) > 1e-3:
        notes.append(f"the gradient in .grad is {check.norm_ratio:.4g}x the probes' sum (clipped in place, or "
                     "loss_fn normalised differently from the training loss): shares and rankings hold, norms "
                     "are in loss_fn's units")
