"""Localize a gradient spike to the loss terms (tokens) that caused it.

``locate(model, loss_fn, token_mask)`` runs exact forward+backward probes of the loss restricted
to subsets of loss terms (``loss_fn(mask)`` with a FIXED normalizer, so subset gradients add up):

- ``auto`` (default): a ghost ranking of every term, each candidate confirmed exactly, a
  remainder check, bisection only where the ranking missed: about ``m + 2`` probes for ``m``
  culprits;
- ``bisect``: our depth-first halving (2 probes per split), ~``2 m log2 N`` probes;
- ``ghost``: one backward with hooks ranks every term (no exact confirmation);
- ``gradloc``: GradLoc's own procedure, faithful to the official code (``gradloc.py``): its
  micro-batch stage, then 2-probe bisection pruned at ``threshold * sqrt(size)``; needs an
  explicit ``threshold`` (GradLoc's per-token knob) and spends no ghost pass.

A step of K micro-batches (gradient accumulation) is given as K loss functions and K masks: the
step's gradient is the sum of the micro-batches' gradients. Each micro-batch is probed once with
its full mask (the ghost pass for ``auto``/``bisect``/``ghost``); their sum is the step's total,
and tokens are searched only inside micro-batches that can hold a culprit. Culprits then carry
``micro_batch``.

It leaves no trace: gradients, module buffers, RNG state, train/eval modes and requires_grad
flags are restored.
"""
from __future__ import annotations

import math
import numbers
import time
from typing import Callable, Sequence

import torch

from ..grouping import LayerGrouping
from ..norms import trainable_params
from . import gradloc
from .probe import Prober, check_loss, restore_rng
from .result import CulpritToken, LocateResult
from .search import Hits, adaptive_tau, auto, bisect, ghost_pass, micro_batch_order, prune_level, term_scores
from .snapshot import Snapshot

__all__ = ["locate", "LocateResult", "CulpritToken"]
METHODS = ("auto", "ghost", "bisect", "gradloc")
LossFn = Callable[[torch.Tensor], torch.Tensor]


def _micro_batches(loss_fn, token_mask) -> tuple[list, list, bool]:
    """(loss_fns, masks, given_as_sequences)."""
    if callable(loss_fn) and isinstance(token_mask, torch.Tensor):
        return [loss_fn], [token_mask], False
    if callable(loss_fn) or isinstance(token_mask, torch.Tensor) or not isinstance(loss_fn, Sequence) \
            or not isinstance(token_mask, Sequence):
        raise TypeError("pass loss_fn as a callable and token_mask as a 2-D tensor, or, for a step of K "
                        "micro-batches, loss_fn as a list of K callables and token_mask as a list of K 2-D "
                        f"tensors; got {type(loss_fn).__name__} and {type(token_mask).__name__}")
    if len(loss_fn) != len(token_mask) or not loss_fn:
        raise ValueError(f"one loss_fn per micro-batch mask: got {len(loss_fn)} loss_fns and {len(token_mask)} "
                         "token masks (pass lists of equal, non-zero length)")
    for i, f in enumerate(loss_fn):
        if not callable(f):
            raise TypeError(f"loss_fn[{i}] must be callable: loss_fn[{i}](mask) -> scalar loss over the kept terms")
    return list(loss_fn), list(token_mask), True


def _check_inputs(model, masks, method, budget, threshold) -> None:
    if method not in METHODS:
        raise ValueError(f"method={method!r} is unknown: use one of {METHODS}")
    if method == "gradloc" and threshold is None:
        raise ValueError("method='gradloc' needs an explicit threshold: GradLoc's per-token knob T, as a per-term "
                         "gradient norm in your loss_fn's units (from the official T with verl's token-mean loss: "
                         "threshold = T * micro_batches / n_norm, n_norm being loss_fn's fixed normalizer); or use "
                         "method='auto' for an adaptive threshold")
    if isinstance(budget, bool) or not isinstance(budget, numbers.Integral) or budget < 1:
        raise ValueError(f"budget={budget!r} must be a positive int number of probes (e.g. budget=128)")
    if threshold is not None and (isinstance(threshold, bool) or not isinstance(threshold, numbers.Real)
                                  or not 0 < threshold < math.inf):
        raise ValueError(f"threshold={threshold!r} must be a positive finite number (the per-term gradient "
                         "norm above which a term is a culprit), or None for an adaptive threshold")
    for i, m in enumerate(masks):
        name = "token_mask" if len(masks) == 1 else f"token_mask[{i}]"
        if not isinstance(m, torch.Tensor) or m.dim() != 2:
            shape = tuple(m.shape) if isinstance(m, torch.Tensor) else type(m).__name__
            raise ValueError(f"{name} must be a 2-D (batch, position) tensor of loss-term weights; got {shape}")
        if not m.is_floating_point():
            raise ValueError(f"{name} must be floating point (1.0 = keep); got {m.dtype}: pass {name}.float()")
    if not trainable_params(model):
        raise ValueError("the model has no parameters with requires_grad=True: nothing to localize")


def _check_additive(prober: Prober, i: int, terms: list, rng: dict) -> None:
    """One forward-only comparison: ``loss(all) == loss(first half) + loss(second half)``.

    Subset probes are only meaningful when the loss is a SUM over kept terms with a fixed
    normalizer; a mean over the kept terms (``/ mask.sum()``) or a term that ignores the mask
    breaks that, and the search would report nonsense.
    """
    mask, fn = prober.masks[i], prober.loss_fns[i]
    half = len(terms) // 2
    with torch.no_grad():
        try:
            vals = []
            for m in (mask, prober.mask_of(i, terms[:half]), prober.mask_of(i, terms[half:])):
                restore_rng(rng)  # same dropout masks for all three, so only the mask differs
                vals.append(fn(m))
        except Exception as exc:
            raise ValueError(f"loss_fn(mask) failed for a mask of shape {tuple(mask.shape)}: {exc!r}. "
                             "token_mask must have the shape loss_fn expects (one entry per loss term)") from exc
    for v in vals:
        check_loss(v)
    full, a, b = (float(v.detach().double()) for v in vals)  # host sync: once per micro-batch
    where = "" if prober.k == 1 else f" (micro-batch {i})"
    fix = ("multiply each per-term loss by mask before reducing, with a FIXED normalizer, e.g. "
           "(per_token_loss * mask).sum() / n_tokens_in_batch, where n_tokens_in_batch is computed from the "
           "full batch, never from mask")
    if full != 0 and a == full and b == full:
        raise ValueError(f"loss_fn(mask) does not depend on the mask{where} (same loss with half the terms "
                         f"dropped): {fix}")
    tol = 2e-2 if vals[0].dtype in (torch.float16, torch.bfloat16) else 1e-3
    if not math.isfinite(full) or abs(full - (a + b)) > tol * max(abs(full), abs(a) + abs(b)) + 1e-12:
        if not (math.isfinite(full) and math.isfinite(a) and math.isfinite(b)):
            return  # non-finite losses are reported once the step's gradient is known
        raise ValueError(f"loss_fn(mask) is not additive over the mask{where}: loss(all terms)={full:.6g} but "
                         f"loss(first half)+loss(second half)={a + b:.6g}. A mean over the kept terms "
                         f"(dividing by mask.sum()) or a term that ignores the mask does this; {fix}")


def _rng_states(rng_state, k: int, now: dict) -> list[dict]:
    if rng_state is None:
        return [now] * k
    if isinstance(rng_state, torch.Tensor):
        return [{"cpu": rng_state}] * k
    if isinstance(rng_state, dict):
        return [rng_state] * k
    states = list(rng_state)
    if len(states) != k:
        raise ValueError(f"rng_state: pass one state, or one per micro-batch ({k}); got {len(states)}")
    return [{"cpu": s} if isinstance(s, torch.Tensor) else s for s in states]


def locate(model: torch.nn.Module, loss_fn: LossFn | Sequence[LossFn], token_mask: torch.Tensor | Sequence[torch.Tensor],
           method: str = "auto", budget: int = 128, threshold: float | None = None, *,
           group_by: str = "block", rng_state=None) -> LocateResult:
    """Find the loss terms whose own gradient is above ``threshold`` (adaptive when None).

    ``loss_fn(mask) -> scalar``: the loss restricted to the terms kept by ``mask`` (same shape as
    ``token_mask``) with a fixed normalizer. For K micro-batches pass K callables and K masks.
    Before any probe, three forward-only passes per micro-batch check that the loss is additive
    over the mask. ``budget`` caps the probes (forward+backward passes); with
    ``method="gradloc"`` it caps the token stage, as GradLoc's ``bisect_budget_steps`` does, and
    the micro-batch stage's one probe per micro-batch comes on top (``result.probes`` counts all).

    Every probe replays one RNG state so dropout masks agree across probes: ``rng_state`` (a
    ``torch.get_rng_state()`` taken before the training forward reproduces that step's masks
    exactly; one per micro-batch may be given), else the state at call time. The caller's RNG
    state is restored afterwards.

    Under ``torch.distributed`` (more than one rank) it is a collective: call it on every rank
    with that rank's own ``loss_fn``/``token_mask``; see ``localizer/distributed.py``.
    """
    from .distributed import is_distributed, locate_distributed

    if is_distributed():  # a collective: every rank calls it (see localizer/distributed.py)
        return locate_distributed(model, loss_fn, token_mask, method, budget, threshold, group_by=group_by,
                                  rng_state=rng_state)
    loss_fns, masks, labelled = _micro_batches(loss_fn, token_mask)
    _check_inputs(model, masks, method, budget, threshold)
    t0 = time.perf_counter()
    snap = Snapshot(model)
    try:
        named = trainable_params(model)
        grouping = LayerGrouping.build([n for n, _ in named], group_by)
        # gradloc: ``budget`` bounds the token stage as GradLoc's ``bisect_budget_steps`` does; its
        # micro-batch stage (one probe each) comes on top, as in the official code
        prober = Prober([p for _, p in named], loss_fns, masks, _rng_states(rng_state, len(masks), snap.rng),
                        budget + (len(masks) if method == "gradloc" else 0), grouping)
        terms = [prober.terms(i) for i in range(prober.k)]
        if not any(terms):
            raise ValueError("token_mask selects no loss terms (all zeros): pass the batch's loss mask")
        for i in range(prober.k):
            if terms[i]:
                _check_additive(prober, i, terms[i], prober.rng_states[i])
        result = _search(prober, model, terms, method, threshold, group_by, labelled)
        result.wall_time_s = time.perf_counter() - t0
        return result
    finally:
        snap.restore()


def _search(prober: Prober, model, terms: list[list], method: str, threshold, group_by: str,
            labelled: bool) -> LocateResult:
    if method == "gradloc":
        return _gradloc(prober, terms, threshold, labelled)
    # micro-batch stage: one full-mask probe (the ghost pass) per micro-batch; their sum is the total
    total, norms, maps, names = None, [], [], None
    for i in range(prober.k):
        if not terms[i]:  # no loss terms: contributes nothing to an additive loss
            norms.append(0.0)
            maps.append(None)
            continue
        g, layer_map, names_i = ghost_pass(prober, i, model, group_by)
        names = names or names_i
        maps.append(_align(layer_map, names_i, names))
        norms.append(prober.norm(g))
        total = g if total is None else prober.add_(total, g)
        del g
    total_sq = prober.norm(total) ** 2
    _finite(total_sq)
    scores = [None if m is None else term_scores(m, prober.masks[i]) for i, m in enumerate(maps)]
    term_score = {(i, *t): float(scores[i][t]) for i in range(prober.k) for t in terms[i]}
    tau = threshold if threshold is not None else adaptive_tau(term_score)
    hits = Hits(prober, total, total_sq, term_score, label=labelled)
    exhausted, notes = False, []
    if method == "auto":
        exhausted, notes = auto(prober, hits, list(term_score), tau, prune_level(term_score, tau))
    elif method == "bisect":
        tau_prune = prune_level(term_score, tau)
        for i in micro_batch_order(norms):
            # a micro-batch whose gradient is within the bisection rule holds no culprit worth a
            # search (with one micro-batch the root is always split, as it always was)
            if not terms[i] or (prober.k > 1 and norms[i] <= tau_prune * math.sqrt(len(terms[i]))):
                continue
            if bisect(prober, i, terms[i], tau, hits, two_probes=True, tau_prune=tau_prune):
                exhausted = True
                break
    else:  # ghost: the ranking itself, no exact confirmation
        idx = {n: j for j, n in enumerate(names)}
        for (i, b, t), s in term_score.items():
            if s > tau:
                hits.tokens.append(CulpritToken(b, t, s, {n: float(maps[i][idx[n], b, t]) for n in names}, score=s,
                                                micro_batch=i if labelled else None))
        notes.append("ghost: grad_norm and layer_norms are per-position estimates, not exact probes")
    tokens = sorted(hits.tokens, key=lambda c: -c.grad_norm)
    single = not labelled
    return LocateResult(tokens=tokens, probes=prober.count, method=method, threshold=float(tau),
                        total_norm=total_sq ** 0.5, layer_names=names or [],
                        ghost_map=scores[0].float() if single else None,
                        layer_map=maps[0].float() if single else None, budget_exhausted=exhausted, notes=notes,
                        micro_batch_norms=[] if single else norms,
                        ghost_maps=[] if single else [None if s is None else s.float() for s in scores],
                        layer_maps=[] if single else [None if m is None else m.float() for m in maps])


def _finite(total_sq: float) -> None:
    if not math.isfinite(total_sq):
        raise FloatingPointError("the batch's gradient is not finite (NaN/Inf): localization needs finite "
                                 "gradients; skip this step or find the bad sample by its loss first")


def _gradloc(prober: Prober, terms: list[list], tau: float, labelled: bool) -> LocateResult:
    budget = prober.budget - prober.k
    total, norms, target = gradloc.micro_batch_stage(prober, terms, tau)
    total_sq = prober.norm(total) ** 2
    _finite(total_sq)
    hits = Hits(prober, total, total_sq, label=labelled)
    exhausted, notes = False, []
    if target < 0:
        notes.append("gradloc: no micro-batch above its threshold; no token search")
    else:
        exhausted = gradloc.token_stage(prober, target, terms[target], tau, budget, hits)
    return LocateResult(tokens=sorted(hits.tokens, key=lambda c: -c.grad_norm), probes=prober.count,
                        method="gradloc", threshold=float(tau), total_norm=total_sq ** 0.5,
                        layer_names=list(prober.grouping.layers), budget_exhausted=exhausted, notes=notes,
                        micro_batch_norms=norms if labelled else [],
                        ghost_maps=[None] * prober.k if labelled else [],
                        layer_maps=[None] * prober.k if labelled else [])


def _align(layer_map: torch.Tensor, names: list[str], order: list[str]) -> torch.Tensor:
    """Rows of ``layer_map`` (named ``names``) in the order ``order``; missing layers are zeros."""
    if names == order:
        return layer_map
    out = torch.zeros((len(order),) + tuple(layer_map.shape[1:]), dtype=layer_map.dtype)
    for j, n in enumerate(order):
        if n in names:
            out[j] = layer_map[names.index(n)]
    return out
