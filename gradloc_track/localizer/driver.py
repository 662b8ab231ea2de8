"""One process's search over a step's loss terms, stage by stage.

1. the micro-batch stage: one full-mask probe per micro-batch (with ghost hooks for ``auto``,
   ``bisect`` and ``ghost``): their sum is the step's gradient and the hooks rank every term;
2. the method's search (``search.auto``, ``search.bisect``, the ranking itself for ``ghost``,
   or GradLoc's own stages in ``gradloc.py``);
3. the result, culprits largest first.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import gradloc
from .probe import Grads, Prober
from .result import CulpritToken, LocateResult
from .search import Hits, adaptive_tau, auto, bisect, ghost_pass, micro_batch_order, prune_level, term_scores


@dataclass
class MicroBatchStage:
    """What the full-mask probes of every micro-batch give."""

    total: Grads  # the step's gradient: the sum of the micro-batches'
    total_sq: float
    norms: list[float]  # per micro-batch
    maps: list[torch.Tensor | None]  # per micro-batch (L, B, T) ghost maps, rows in ``names`` order
    names: list[str]
    scores: list[torch.Tensor | None]  # per micro-batch (B, T) term scores
    term_score: dict[tuple[int, int, int], float]  # (micro_batch, b, t) -> score


def search(prober: Prober, model: torch.nn.Module, terms: list[list], method: str, threshold: float | None,
           group_by: str, labelled: bool) -> LocateResult:
    """Run ``method`` over the step's terms; ``labelled``: culprits carry ``micro_batch``."""
    if method == "gradloc":
        return gradloc_search(prober, terms, threshold, labelled)
    stage = micro_batch_stage(prober, model, terms, group_by)
    tau = threshold if threshold is not None else adaptive_tau(stage.term_score)
    hits = Hits(prober, stage.total, stage.total_sq, stage.term_score, label=labelled)
    exhausted, notes = METHOD_SEARCH[method](prober, stage, terms, tau, hits, labelled)
    single = not labelled
    return LocateResult(tokens=sorted(hits.tokens, key=lambda c: -c.grad_norm), probes=prober.count,
                        method=method, threshold=float(tau), total_norm=stage.total_sq ** 0.5,
                        layer_names=stage.names or [],
                        ghost_map=stage.scores[0].float() if single else None,
                        layer_map=stage.maps[0].float() if single else None, budget_exhausted=exhausted,
                        notes=notes, micro_batch_norms=[] if single else stage.norms,
                        ghost_maps=[] if single else [None if s is None else s.float() for s in stage.scores],
                        layer_maps=[] if single else [None if m is None else m.float() for m in stage.maps])


def micro_batch_stage(prober: Prober, model: torch.nn.Module, terms: list[list], group_by: str) -> MicroBatchStage:
    """One ghost pass per micro-batch: the step's total gradient and every term's score."""
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
    check_finite(total_sq)
    scores = [None if m is None else term_scores(m, prober.masks[i]) for i, m in enumerate(maps)]
    term_score = {(i, *t): float(scores[i][t]) for i in range(prober.k) for t in terms[i]}
    return MicroBatchStage(total, total_sq, norms, maps, names or [], scores, term_score)


def _auto(prober, stage: MicroBatchStage, terms, tau, hits, labelled) -> tuple[bool, list[str]]:
    return auto(prober, hits, list(stage.term_score), tau, prune_level(stage.term_score, tau))


def _bisect(prober, stage: MicroBatchStage, terms, tau, hits, labelled) -> tuple[bool, list[str]]:
    tau_prune = prune_level(stage.term_score, tau)
    for i in micro_batch_order(stage.norms):
        # a micro-batch whose gradient is within the bisection rule holds no culprit worth a
        # search (with one micro-batch the root is always split, as it always was)
        if not terms[i] or (prober.k > 1 and stage.norms[i] <= tau_prune * math.sqrt(len(terms[i]))):
            continue
        if bisect(prober, i, terms[i], tau, hits, two_probes=True, tau_prune=tau_prune):
            return True, []
    return False, []


def _ghost(prober, stage: MicroBatchStage, terms, tau, hits, labelled) -> tuple[bool, list[str]]:
    """The ranking itself, no exact confirmation."""
    idx = {n: j for j, n in enumerate(stage.names)}
    for (i, b, t), s in stage.term_score.items():
        if s > tau:
            layers = {n: float(stage.maps[i][idx[n], b, t]) for n in stage.names}
            hits.tokens.append(CulpritToken(b, t, s, layers, score=s, micro_batch=i if labelled else None))
    return False, ["ghost: grad_norm and layer_norms are per-position estimates, not exact probes"]


METHOD_SEARCH = {"auto": _auto, "bisect": _bisect, "ghost": _ghost}


def gradloc_search(prober: Prober, terms: list[list], tau: float, labelled: bool) -> LocateResult:
    """GradLoc's own procedure (``gradloc.py``): its micro-batch stage, then its token stage."""
    budget = prober.budget - prober.k
    total, norms, target = gradloc.micro_batch_stage(prober, terms, tau)
    total_sq = prober.norm(total) ** 2
    check_finite(total_sq)
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


def check_finite(total_sq: float) -> None:
    if not math.isfinite(total_sq):
        raise FloatingPointError("the batch's gradient is not finite (NaN/Inf): localization needs finite "
                                 "gradients; skip this step or find the bad sample by its loss first")


def _align(layer_map: torch.Tensor, names: list[str], order: list[str] | None) -> torch.Tensor:
    """Rows of ``layer_map`` (named ``names``) in the order ``order``; missing layers are zeros."""
    if order is None or names == order:
        return layer_map
    out = torch.zeros((len(order),) + tuple(layer_map.shape[1:]), dtype=layer_map.dtype)
    for j, n in enumerate(order):
        if n in names:
            out[j] = layer_map[names.index(n)]
    return out
