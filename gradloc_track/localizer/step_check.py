"""Do the probes reproduce the step? Their sum against the gradient the step's backward left.

Every probe replays its micro-batch's RNG state, so dropout masks repeat; when the states are the
ones saved right before each micro-batch's training forward, the sum of the K full-mask probes
IS the step's gradient (``.grad`` before localizing). That is checked once, at no probe's cost:
when nobody said what rescaled ``.grad`` (``Reference.scale`` None: a caller's own clipper), with
the best scale per tensor (a clipper that rescaled ``.grad`` in place is not a difference; dropout
replayed from the wrong state, a stateful module or another loss are); when the caller said (a
clipper's coefficients, or 1: nothing of ours rescaled it), with one scale for the whole step only
(a user's global clip, another normalisation): one tensor 40x its replay is then another step, as
is a flipped bit.
When it fails, one more forward pass tells randomness the RNG cannot replay from the rest, and
the result says why (``StepCheck.reason``, a warning, a note in the artifacts).

When the caller knows what the step did to ``.grad`` after backward (``LocateStep.grad_scale``: the
clipper's per-tensor coefficients, since the monitor clips before it localizes), the reference
carries it (``Reference``) and the check compares ``scale * (the probes' sum)`` with ``.grad``: a
clipped step then IS the step (``norm_ratio`` 1, ``StepCheck.scale`` 1 when ``loss_fn`` is the
training loss, no note), and the shares, which the probes compute fresh, are unchanged.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

from .probe import Grads, Prober, restore_rng
from .result import StepCheck

HALF = (torch.float16, torch.bfloat16)


@dataclass
class Reference:
    """The step's gradient as the localizer found it (``.grad``, one entry per probed tensor, None
    where there was none) and what the step multiplied it by after backward (``scale``: a number,
    or one per tensor, e.g. a clipper's ``coef_t``; None: nothing)."""

    grads: list[torch.Tensor | None] | None
    scale: torch.Tensor | float | None = None
    reduced: bool = False  # the training forward ran in reduced precision (autocast): half-precision rounding


def check_step(prober: Prober, total: Grads, reference: Reference | list[torch.Tensor | None] | None,
               reduce: Callable[[torch.Tensor], torch.Tensor] | None = None, explain: bool = True) -> StepCheck | None:
    """Compare ``total`` (the probes' sum, times ``reference.scale`` when given) with the step's
    ``.grad``; None when the step left no gradient to compare with. ``reference``: a
    ``Reference``, or the bare list of gradients. ``reduce``: sums per-tensor values of local
    shards over the ranks that shard them (``torch.distributed``); ``explain=False`` gives a
    generic reason instead of running the model again (a collective under DDP)."""
    grads, factor = (reference.grads, reference.scale) if isinstance(reference, Reference) else (reference, None)
    reduced = isinstance(reference, Reference) and reference.reduced
    if grads is None or all(r is None for r in grads):
        return None
    residual, ratio, scale = _compare(total, grads, reduce or (lambda v: v), factor)
    if ratio == 0:
        return None  # zeroed gradients (zero_grad(set_to_none=False)): nothing to compare with
    tol = 3e-2 if reduced or any(t.dtype in HALF for t in total) else 1e-3  # a half precision's rounding
    if residual <= tol:
        fits = scale is not None and scale[1] <= tol  # one scale explains .grad (no per-tensor clipping)
        return StepCheck(residual, ratio, True, scale=scale[0] if fits else None, tol=tol)
    return StepCheck(residual, ratio, False, _why(prober) if explain else UNEXPLAINED, tol=tol)


UNEXPLAINED = ("the probes do not add up to the step's gradient: other randomness (pass the RNG state saved right "
               "before each micro-batch's forward), a model changed since backward, or a loss_fn that is not the "
               "training loss")


def _compare(total: Grads, reference: list[torch.Tensor | None], reduce: Callable[[torch.Tensor], torch.Tensor],
             factor: torch.Tensor | float | None = None) -> tuple[float, float, tuple[float, float] | None]:
    """(relative residual, ||reference|| / ||total||, (scale, its residual) or None), ``total``
    taken times ``factor`` (one number or one per tensor; None: 1) in float64.

    The residual is ``||total - ref|| / ||total||`` when that is already small (no rescaling), else
    the one left after the best scale per tensor (``factor`` None: what rescaled ``.grad`` is not
    known) or after the best ONE scale (``factor`` given: per-tensor rescaling is not the step).
    ``scale`` is the ONE number with ``ref = scale * total`` (least squares), with
    ``||ref - scale * total|| / ||ref||``: what a caller that works in ``.grad``'s units (spike
    surgery) needs. Per-tensor values in float64 (``||t||^2``, ``||r||^2``, ``||t - r||^2`` formed
    elementwise, ``<t, r>``), one tensor-sized temporary at a time, reduced
    over shards, moved to the host once."""
    rows = []
    for t, r, f in zip(total, reference, _factors(factor, len(total))):
        t64, r64 = t.detach().double(), _dense_like(r, t).double()
        if not isinstance(f, float) or f != 1.0:
            t64 = t64 * (f.to(t64.device) if isinstance(f, torch.Tensor) else f)
        rows.append(torch.stack([t64.square().sum(), r64.square().sum(), (t64 - r64).square().sum(),
                                 (t64 * r64).sum()]))
    per = reduce(torch.stack(rows))  # (n, 4)
    t_sq, r_sq, d_sq, dot = per.sum(0).tolist()  # host sync: once per localization
    if t_sq == 0:
        return (0.0 if r_sq == 0 else math.inf), (1.0 if r_sq == 0 else math.inf), None
    ratio = math.sqrt(r_sq / t_sq)
    scale = None
    if r_sq > 0:
        s = dot / t_sq
        scale = (s, math.sqrt(max(0.0, r_sq - s * dot) / r_sq))  # ||r - s t||^2 = ||r||^2 - s <t, r>
    raw = math.sqrt(d_sq / t_sq)
    if raw <= 1e-3:
        return raw, ratio, scale
    if factor is not None:  # ||t - a r||^2 with the best ONE a: ||t||^2 - <t, r>^2 / ||r||^2
        left = max(0.0, t_sq - dot * dot / r_sq) if r_sq > 0 else t_sq
        return math.sqrt(left / t_sq), ratio, scale
    ts, rs, ds = per[:, 0], per[:, 1], per[:, 3]
    # per tensor, ||t - a r||^2 with the best a = <t, r> / ||r||^2 is ||t||^2 - <t, r>^2 / ||r||^2
    left = torch.where(rs > 0, ts - ds.square() / rs.clamp_min(1e-300), ts).clamp_min(0.0)
    return math.sqrt(float(left.sum()) / t_sq), ratio, scale


def _factors(factor: torch.Tensor | float | None, n: int) -> list:
    """One multiplier per tensor: ``factor``'s entries (0-d device tensors: no host sync), or the one number."""
    if isinstance(factor, torch.Tensor) and factor.dim() == 1:
        return list(factor.detach().double().unbind())
    if isinstance(factor, torch.Tensor):
        return [factor.detach().double()] * n
    return [1.0 if factor is None else float(factor)] * n


def _dense_like(r: torch.Tensor | None, t: torch.Tensor) -> torch.Tensor:
    if r is None:
        return torch.zeros_like(t)
    r = r.detach().to(t.device)
    return (r.to_dense() if r.is_sparse else r).to(t.dtype)


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
    elif abs(check.norm_ratio - 1.0) > check.tol:  # (half precision: its rounding is no rescaling; stop 54)
        notes.append(f"the gradient in .grad is {check.norm_ratio:.4g}x the probes' sum (clipped in place, or "
                     "loss_fn normalised differently from the training loss): shares and rankings hold, norms "
                     "are in loss_fn's units")
