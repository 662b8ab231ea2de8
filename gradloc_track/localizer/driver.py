"""One process's search over a step's loss terms, stage by stage, top-down.

1. the micro-batch stage: one full-mask probe per micro-batch (with ghost hooks for ``auto``,
   ``bisect`` and ``ghost``): their sum is the step's gradient, checked against ``.grad``
   (``step_check.py``); the hooks rank every term and give every sample's exact norm;
2. samples, spans (``levels.py``; ``auto`` and ``bisect``): samples that stand out of the others
   and are not carried by a few tokens are confirmed with exact probes;
3. the method's token search over the other terms (``search.auto``, ``search.bisect``, the
   ranking itself for ``ghost``, or GradLoc's own stages in ``gradloc.py``), with a threshold
   from the ordinary terms (``threshold.py``);
4. micro-batches that stand out and hold no culprit; when nothing was found, the per-sample
   shares; the result, coarse units first, then tokens largest first.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import gradloc, levels, step_check
from .nonfinite import NonfiniteStep
from .probe import Grads, Prober
from .result import CulpritToken, LocateResult
from .search import Hits, adaptive_tau, auto, bisect, ghost_pass, micro_batch_order, prune_level, term_scores
from .segments import Segments


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
    segments: list[Segments | None]  # per micro-batch samples with their exact ghost norms


def find_culprits(prober: Prober, model: torch.nn.Module, terms: list[list], method: str, threshold: float | None,
           group_by: str, labelled: bool, document_ids: list | None = None,
           reference: list | None = None) -> LocateResult:
    """Run ``method`` over the step's terms; ``labelled``: culprits carry ``micro_batch``;
    ``document_ids``: per micro-batch (B, T) ids of packed documents (or None); ``reference``:
    the step's gradient as backward left it (``.grad``), to check the probes against."""
    if method == "gradloc":
        return gradloc_search(prober, terms, threshold, labelled, reference)
    with_units = method in ("auto", "bisect")
    docs = document_ids or [None] * prober.k
    segs = [Segments(i, prober.masks[i], docs[i]) if with_units and terms[i] else None for i in range(prober.k)]
    if sum(len(s) for s in segs if s is not None) < 2:  # one sample: nothing to compare it with
        segs = [None] * prober.k
    stage = micro_batch_stage(prober, model, terms, group_by, segs)
    notes: list[str] = []
    check = step_check.check_step(prober, stage.total, reference)
    step_check.report(check, notes)
    cands, limit, n_samples = levels.candidates(segs) if with_units else ([], math.inf, 0)
    tau = threshold if threshold is not None else adaptive_tau(levels.ordinary(stage.term_score, _inside(cands)))
    hits = Hits(prober, stage.total, stage.total_sq, stage.term_score, label=labelled)
    units = levels.find_units(prober, hits, cands, limit, stage.term_score, tau, labelled, n_samples)
    score = {k: v for k, v in stage.term_score.items() if k not in units.excluded}
    exhausted, found_notes = units.exhausted, []
    if not exhausted:
        exhausted, found_notes = METHOD_SEARCH[method](prober, stage, score, tau, hits, _base(prober, stage, units))
    coarse = units.culprits
    if with_units and not exhausted:
        holding = {c.micro_batch for c in coarse + hits.tokens}
        coarse = coarse + levels.micro_batch_units(prober, hits, stage.norms, terms, holding, labelled)
    shares = []
    if with_units and not coarse and not hits.tokens:
        shares = levels.sample_shares(prober, hits, segs, labelled)
        notes.append(levels.no_culprit_note(shares, sum(len(s) for s in segs if s is not None)))
    return _result(prober, stage, method, tau, hits, coarse, shares, check, exhausted, notes + found_notes,
                   labelled)


def _inside(cands: list) -> set:
    return {(seg.micro_batch, b, t) for seg, _ in cands for b, t in seg.terms}


def _base(prober: Prober, stage: MicroBatchStage, units: levels.Units) -> Grads | None:
    """The gradient of the terms left to the token search: the total minus the reported samples'."""
    if units.grad is None:
        return None
    torch._foreach_neg_(units.grad)
    base = prober.add_(units.grad, stage.total)  # in the units' buffer: no new one
    units.grad = None
    return base


def _result(prober: Prober, stage: MicroBatchStage, method: str, tau: float, hits: Hits, coarse: list,
            shares: list, check, exhausted: bool, notes: list[str], labelled: bool) -> LocateResult:
    tokens = sorted(hits.tokens, key=lambda c: -c.grad_norm)
    coarse = sorted(coarse, key=lambda c: -(c.share if c.share is not None else -math.inf))
    single = not labelled
    return LocateResult(tokens=tokens, probes=prober.count, method=method, threshold=float(tau),
                        total_norm=stage.total_sq ** 0.5, layer_names=stage.names or [],
                        ghost_map=stage.scores[0].float() if single and stage.scores[0] is not None else None,
                        layer_map=stage.maps[0].float() if single and stage.maps[0] is not None else None,
                        budget_exhausted=exhausted, notes=notes, micro_batch_norms=[] if single else stage.norms,
                        ghost_maps=[] if single else [None if s is None else s.float() for s in stage.scores],
                        layer_maps=[] if single else [None if m is None else m.float() for m in stage.maps],
                        culprits=coarse + tokens, step_check=check, sample_shares=shares)


def micro_batch_stage(prober: Prober, model: torch.nn.Module, terms: list[list], group_by: str,
                      segments: list[Segments | None] | None = None) -> MicroBatchStage:
    """One ghost pass per micro-batch: the step's total gradient, every term's score and (with
    ``segments``) every sample's exact norm over the hooked layers."""
    segments = segments or [None] * prober.k
    total, norms, maps, names = None, [], [], None
    for i in range(prober.k):
        if not terms[i]:  # no loss terms: contributes nothing to an additive loss
            norms.append(0.0)
            maps.append(None)
            continue
        g, layer_map, names_i = ghost_pass(prober, i, model, group_by, segments[i])
        names = names or names_i
        maps.append(_align(layer_map, names_i, names))
        norms.append(prober.norm(g))
        total = g if total is None else prober.add_(total, g)
        del g
    total_sq = prober.norm(total) ** 2
    check_finite(total_sq, norms, total)
    scores = [None if m is None else term_scores(m, prober.masks[i]) for i, m in enumerate(maps)]
    term_score = {(i, *t): float(scores[i][t]) for i in range(prober.k) for t in terms[i]}
    return MicroBatchStage(total, total_sq, norms, maps, names or [], scores, term_score, segments)


# each method's token search over ``score``'s terms (the step's, less those of reported samples),
# ``base`` their gradient (None: the step's total); returns (budget_exhausted, notes)
def _auto(prober, stage: MicroBatchStage, score: dict, tau: float, hits: Hits, base) -> tuple[bool, list[str]]:
    return auto(prober, hits, list(score), tau, prune_level(score, tau), base=base)


def _bisect(prober, stage: MicroBatchStage, score: dict, tau: float, hits: Hits, base) -> tuple[bool, list[str]]:
    tau_prune = prune_level(score, tau)
    for i in micro_batch_order(stage.norms):
        terms_i = [k[1:] for k in score if k[0] == i]
        # a micro-batch whose gradient is within the bisection rule holds no culprit worth a
        # search (with one micro-batch the root is always split, as it always was)
        if not terms_i or (prober.k > 1 and stage.norms[i] <= tau_prune * math.sqrt(len(terms_i))):
            continue
        if bisect(prober, i, terms_i, tau, hits, two_probes=True, tau_prune=tau_prune):
            return True, []
    return False, []


def _ghost(prober, stage: MicroBatchStage, score: dict, tau: float, hits: Hits, base) -> tuple[bool, list[str]]:
    """The ranking itself, no exact confirmation."""
    idx = {n: j for j, n in enumerate(stage.names)}
    for (i, b, t), s in score.items():
        if s > tau:
            layers = {n: float(stage.maps[i][idx[n], b, t]) for n in stage.names}
            hits.tokens.append(CulpritToken(b, t, s, layers, score=s, micro_batch=i if hits.label else None))
    return False, ["ghost: grad_norm and layer_norms are per-position estimates, not exact probes"]


METHOD_SEARCH = {"auto": _auto, "bisect": _bisect, "ghost": _ghost}


def gradloc_search(prober: Prober, terms: list[list], tau: float, labelled: bool,
                   reference: list | None = None) -> LocateResult:
    """GradLoc's own procedure (``gradloc.py``): its micro-batch stage, then its token stage; the
    step check costs no probe and changes nothing in the procedure."""
    budget = prober.budget - prober.k
    total, norms, target = gradloc.micro_batch_stage(prober, terms, tau)
    total_sq = prober.norm(total) ** 2
    check_finite(total_sq, norms, total)
    notes: list[str] = []
    check = step_check.check_step(prober, total, reference)
    step_check.report(check, notes)
    hits = Hits(prober, total, total_sq, label=labelled)
    exhausted = False
    if target < 0:
        notes.append("gradloc: no micro-batch above its threshold; no token search")
    else:
        exhausted = gradloc.token_stage(prober, target, terms[target], tau, budget, hits)
    return LocateResult(tokens=sorted(hits.tokens, key=lambda c: -c.grad_norm), probes=prober.count,
                        method="gradloc", threshold=float(tau), total_norm=total_sq ** 0.5,
                        layer_names=list(prober.grouping.layers), budget_exhausted=exhausted, notes=notes,
                        micro_batch_norms=norms if labelled else [],
                        ghost_maps=[None] * prober.k if labelled else [],
                        layer_maps=[None] * prober.k if labelled else [], step_check=check)


def check_finite(total_sq: float, norms: list[float], total: Grads) -> None:
    """A non-finite sum of the micro-batches' probes stops the norm search: ``locate`` runs the
    non-finite search (``nonfinite.py``) on ``NonfiniteStep`` instead."""
    if not math.isfinite(total_sq):
        raise NonfiniteStep(norms, total)


def _align(layer_map: torch.Tensor, names: list[str], order: list[str] | None) -> torch.Tensor:
    """Rows of ``layer_map`` (named ``names``) in the order ``order``; missing layers are zeros."""
    if order is None or names == order:
        return layer_map
    out = torch.zeros((len(order),) + tuple(layer_map.shape[1:]), dtype=layer_map.dtype)
    for j, n in enumerate(order):
        if n in names:
            out[j] = layer_map[names.index(n)]
    return out
