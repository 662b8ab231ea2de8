"""Localize a gradient spike to the loss terms (tokens) that caused it.

``locate(model, loss_fn, token_mask)`` runs exact forward+backward probes of the loss restricted
to subsets of loss terms (``loss_fn(mask)`` with a FIXED normalizer, so subset gradients add up):

- ``bisect``: GradLoc's depth-first halving, 2 probes per split, ~``2 m log2 N`` probes;
- ``ghost``: one backward with hooks ranks every term (no exact confirmation);
- ``auto`` (default): the ghost ranking, each candidate confirmed exactly, a remainder check,
  bisection only where the ranking missed: about ``m + 2`` probes for ``m`` culprits.

It leaves no trace: gradients, RNG state, train/eval modes and requires_grad flags are restored.
"""
from __future__ import annotations

import time
from typing import Callable

import torch

from ..grouping import LayerGrouping
from ..norms import trainable_params
from .probe import Prober, restore_rng
from .result import CulpritToken, LocateResult
from .search import _token, auto, bisect, ghost_pass, prune_level, term_scores
from .ghost import adaptive_threshold
from .snapshot import Snapshot

__all__ = ["locate", "LocateResult", "CulpritToken"]
METHODS = ("auto", "ghost", "bisect")


def _check_inputs(model, loss_fn, token_mask, method, budget, threshold) -> list[tuple[int, int]]:
    if method not in METHODS:
        raise ValueError(f"method={method!r} is unknown: use one of {METHODS}")
    if not isinstance(budget, int) or budget < 1:
        raise ValueError(f"budget={budget!r} must be a positive number of probes (e.g. 128)")
    if threshold is not None and not threshold > 0:
        raise ValueError(f"threshold={threshold!r} must be positive, or None for an adaptive threshold")
    if not callable(loss_fn):
        raise TypeError("loss_fn must be callable: loss_fn(mask) -> scalar loss over the kept loss terms")
    if not isinstance(token_mask, torch.Tensor) or token_mask.dim() != 2:
        shape = tuple(token_mask.shape) if isinstance(token_mask, torch.Tensor) else type(token_mask).__name__
        raise ValueError(f"token_mask must be a 2-D (batch, position) tensor of loss-term weights; got {shape}")
    if not token_mask.is_floating_point():
        raise ValueError(f"token_mask must be floating point (1.0 = keep); got {token_mask.dtype}: "
                         "pass token_mask.float()")
    if not trainable_params(model):
        raise ValueError("the model has no parameters with requires_grad=True: nothing to localize")
    terms = [tuple(int(i) for i in ix) for ix in (token_mask != 0).nonzero().tolist()]
    if not terms:
        raise ValueError("token_mask selects no loss terms (all zeros): pass the batch's loss mask")
    return terms


def _check_mask_dependence(loss_fn, token_mask, rng: dict) -> None:
    """The loss must change when terms are dropped, else subset probes are meaningless."""
    with torch.no_grad():
        try:
            restore_rng(rng)  # same dropout masks for both, so only the mask differs
            full = loss_fn(token_mask)
            restore_rng(rng)
            empty = loss_fn(torch.zeros_like(token_mask))
        except Exception as exc:
            raise ValueError(f"loss_fn(mask) failed for a mask of shape {tuple(token_mask.shape)}: {exc!r}. "
                             "token_mask must have the shape loss_fn expects (one entry per loss term)") from exc
    if torch.equal(full.detach(), empty.detach()):
        raise ValueError("loss_fn(mask) does not depend on the mask (same loss with all terms dropped): "
                         "multiply each per-term loss by mask before reducing, with a fixed normalizer, "
                         "e.g. (per_token_loss * mask).sum() / n_tokens_in_batch")


def locate(model: torch.nn.Module, loss_fn: Callable[[torch.Tensor], torch.Tensor], token_mask: torch.Tensor,
           method: str = "auto", budget: int = 128, threshold: float | None = None, *,
           group_by: str = "block", rng_state: dict | torch.Tensor | None = None) -> LocateResult:
    """Find the loss terms whose own gradient is above ``threshold`` (adaptive when None).

    Every probe replays one RNG state so dropout masks agree across probes: ``rng_state`` (a
    ``torch.get_rng_state()`` taken before the training forward reproduces that step's masks
    exactly), else the state at call time. The caller's RNG state is restored afterwards.

    Under ``torch.distributed`` (more than one rank) it is a collective: call it on every rank
    with that rank's own ``loss_fn``/``token_mask``; see ``locate/distributed.py``.
    """
    from .distributed import is_distributed, locate_distributed

    if is_distributed():  # a collective: every rank calls it (see locate/distributed.py)
        return locate_distributed(model, loss_fn, token_mask, method, budget, threshold, group_by=group_by,
                                  rng_state=rng_state)
    terms = _check_inputs(model, loss_fn, token_mask, method, budget, threshold)
    t0 = time.perf_counter()
    snap = Snapshot(model)
    try:
        _check_mask_dependence(loss_fn, token_mask, snap.rng)
        named = trainable_params(model)
        grouping = LayerGrouping.build([n for n, _ in named], group_by)
        replay = snap.rng if rng_state is None else (
            {"cpu": rng_state} if isinstance(rng_state, torch.Tensor) else rng_state)
        prober = Prober([p for _, p in named], loss_fn, token_mask, replay, budget, grouping)
        notes: list[str] = []
        if method == "auto":
            found, total, layer_map, names, scores, tau, exhausted, notes, term_score = \
                auto(prober, model, terms, threshold, group_by)
        else:
            total, layer_map, names = ghost_pass(prober, model, group_by)
            scores = term_scores(layer_map, token_mask)
            term_score = {t: float(scores[t]) for t in terms}
            tau = threshold if threshold is not None else adaptive_threshold(
                torch.tensor([term_score[t] for t in terms]))
            exhausted = False
            if method == "bisect":
                found, exhausted = bisect(prober, terms, tau, two_probes=True,
                                          tau_prune=prune_level(term_score, tau, threshold is not None))
            else:
                found = []
        total_sq = prober.norm(total) ** 2
        if not torch.isfinite(torch.tensor(total_sq)):
            raise FloatingPointError("the batch's gradient is not finite (NaN/Inf): localization needs finite "
                                     "gradients; skip this step or find the bad sample by its loss first")
        if method == "ghost":
            layer_idx = {n: i for i, n in enumerate(names)}
            tokens = [CulpritToken(t[0], t[1], term_score[t],
                                   {n: float(layer_map[layer_idx[n], t[0], t[1]]) for n in names},
                                   score=term_score[t]) for t in terms if term_score[t] > tau]
            notes.append("ghost: grad_norm and layer_norms are per-position estimates, not exact probes")
        else:
            tokens = [_token(prober, t, g, total, total_sq, term_score.get(t)) for t, g in found]
        tokens.sort(key=lambda c: -c.grad_norm)
        return LocateResult(tokens=tokens, probes=prober.count, method=method, threshold=float(tau),
                            total_norm=total_sq ** 0.5, layer_names=names, ghost_map=scores.float(),
                            layer_map=layer_map.float(), budget_exhausted=exhausted,
                            wall_time_s=time.perf_counter() - t0, notes=notes)
    finally:
        snap.restore()
