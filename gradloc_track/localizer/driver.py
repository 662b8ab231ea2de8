"""One process's search over a step's loss terms, stage by stage, top-down.

1. the micro-batch stage: one full-mask probe per micro-batch (with ghost hooks for ``auto``,
   ``bisect`` and ``ghost``): their sum is the step's gradient, checked against ``.grad``
   (``step_check.py``); the hooks rank every term and give every sample's exact norm. When the
   check finds ``.grad`` to BE that sum (to 1e-6, unscaled), ``.grad`` stands in for it and our
   copy is dropped: the search then holds one gradient-sized buffer of its own at most;
2. samples, spans (``levels.py``; ``auto`` and ``bisect``): candidate samples decided on coherent
   norms, each by its few hot terms or by its own probe;
3. the method's token search over the other terms (``search.auto``, ``search.bisect``, the
   ranking itself for ``ghost``, or GradLoc's own stages in ``gradloc.py``), with a threshold
   from the ordinary terms (``threshold.py``);
4. micro-batches that stand out and hold no culprit; when nothing was found, the per-sample
   shares; the result, coarse units first, then tokens largest first, under the share floor
   (``result.floor_rows``). A budget that ran out is said as such, never as "nothing found".
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from . import gradloc, levels, step_check
from .flagged import Flag, name_flagged
from .nonfinite import NonfiniteStep
from .probe import BudgetExhausted, Grads, Prober
from .result import CulpritToken, LocateResult, StepCheck, ranked_rows
from .search import Hits, adaptive_tau, auto, bisect, ghost_pass, micro_batch_order, prune_level, term_scores
from .segments import Segments

SAME_STEP = 1e-6  # .grad stands in for the probes' sum when it is that sum to this relative residual


@dataclass(frozen=True)
class Search:
    """What to search and with what: ``method``, ``threshold`` (None: adaptive), ``group_by``;
    ``labelled``: culprits carry ``micro_batch``; ``document_ids``: per micro-batch (B, T) ids
    of packed documents (or None); ``reference``: the step's gradient as backward left it
    (``.grad``, with what the step multiplied it by: ``step_check.Reference``), to check the
    probes against."""

    method: str
    threshold: float | None = None
    group_by: str = "block"
    labelled: bool = False
    document_ids: list | None = None
    reference: step_check.Reference | list | None = None
    flagged: Sequence[Flag] = ()  # units a data signal points at (``flagged.py``): named whatever their share
    cut: Any = None  # a ``cut.CulpritCut``: ``auto`` copies the summed gradient of what it explained into it


@dataclass
class MicroBatchStage:
    """What the full-mask probes of every micro-batch give."""

    total: Grads  # the step's gradient: the sum of the micro-batches' (or .grad, when it is that sum)
    total_sq: float
    norms: list[float]  # per micro-batch
    # per micro-batch (L, B, T) ghost maps, rows in ``names`` order: bfloat16 while the search runs
    # (position-sized, held beside its buffers; ~3 significant digits is all a heatmap shows), float32 in the result
    maps: list[torch.Tensor | None]
    names: list[str]
    scores: list[torch.Tensor | None]  # per micro-batch (B, T) term scores
    term_score: dict[tuple[int, int, int], float]  # (micro_batch, b, t) -> score
    segments: list[Segments | None]  # per micro-batch samples with their exact ghost norms


@dataclass
class Found:
    """What the stages found: token hits, coarse rows, per-sample shares (when nothing else),
    the step check, whether the budget ran out, notes."""

    hits: Hits
    coarse: list = field(default_factory=list)
    shares: list = field(default_factory=list)
    check: StepCheck | None = None
    exhausted: bool = False
    notes: list[str] = field(default_factory=list)
    flagged: list = field(default_factory=list)  # rows named for what a data signal saw, not their share


def find_culprits(prober: Prober, model: torch.nn.Module, terms: list[list], search: Search) -> LocateResult:
    """Run ``search.method`` over the step's ``terms`` (per micro-batch, ``(b, t)``)."""
    return _find(prober, model, terms, search)


def _find(prober: Prober, model: torch.nn.Module, terms: list[list], search: Search) -> LocateResult:
    if search.method == "gradloc":
        return gradloc_search(prober, terms, search.threshold, search.labelled, search.reference)
    with_units = search.method in ("auto", "bisect")
    docs = search.document_ids or [None] * prober.k
    segs = [Segments(i, prober.masks[i], docs[i], terms[i]) if with_units and terms[i] else None
            for i in range(prober.k)]
    if sum(len(s) for s in segs if s is not None) < 2:  # one sample: nothing to compare it with
        segs = [None] * prober.k
    try:
        stage = micro_batch_stage(prober, model, terms, search.group_by, segs)
    except BudgetExhausted:
        return _starved(prober, search, terms)
    found = Found(Hits(prober, stage.total, stage.total_sq, stage.term_score, label=search.labelled))
    found.hits.cut = search.cut
    found.check = step_check.check_step(prober, stage.total, search.reference)
    step_check.report(found.check, found.notes)
    _stand_in(prober, stage, found, search.reference)
    # a step only data signals fired on (no gradient norm jumped) is answered by the units they flag: a unit
    # that merely carries most of an ordinary gradient is no culprit of it (tester round 12: a clean row at
    # 44% was named, quarantined and operated on, while the two garbage rows whose loss fired were not)
    # (the ghost method searches no units and names no flags: it keeps its own token search; review, stop 51)
    alone = with_units and any(getattr(f, "alone", False) for f in search.flagged)
    cands, limit, n_samples = levels.candidates(segs) if with_units and not alone else ([], math.inf, 0)
    tau = search.threshold if search.threshold is not None else \
        adaptive_tau(levels.ordinary(stage.term_score, _inside(cands)))
    units = levels.find_units(prober, found.hits, cands, limit, stage.term_score, tau, search.labelled, n_samples)
    if not units.exhausted and not alone:
        score = {k: v for k, v in stage.term_score.items() if k not in found.hits.terms}
        exhausted, more = METHOD_SEARCH[search.method](prober, stage, score, tau, found.hits, units)
        units.exhausted |= exhausted
        found.notes += more
    found.coarse, found.exhausted = units.culprits, units.exhausted
    units.grad = None
    if with_units and not found.exhausted and not alone:
        holding = {c.micro_batch for c in found.coarse + found.hits.tokens}
        found.coarse += levels.micro_batch_units(prober, found.hits, stage.norms, terms, holding, search.labelled)
        if not found.coarse and not found.hits.tokens:
            found.shares, named = levels.sample_shares(prober, found.hits, segs, search.labelled)
            found.coarse += named
            if not named:
                found.notes.append(levels.no_culprit_note(found.shares, sum(len(s) for s in segs if s is not None)))
        elif _carried(found) < levels.SCAN_BELOW and any(s is not None for s in segs):
            found.coarse += levels.more_samples(prober, found.hits, segs, search.labelled, found.hits.terms)
    if with_units and search.flagged:
        found.flagged, more = name_flagged(prober, found.hits, terms, search.flagged,
                                           found.coarse + found.hits.tokens, search.labelled, search.document_ids)
        found.notes += more
    return _result(prober, stage, search, tau, found)


def _carried(found: Found) -> float:
    """The summed share of the culprits found so far (rows without one count 0)."""
    return sum(c.share or 0.0 for c in found.coarse + found.hits.tokens)


def _inside(cands: list) -> set:
    return {(seg.micro_batch, b, t) for seg, _ in cands for b, t in seg.terms}


def _stand_in(prober: Prober, stage: MicroBatchStage, found: Found, reference) -> None:
    """``.grad`` stands in for the probes' sum when the check found them the same step (module
    doc): shares are dot products with it, and our copy of the total is dropped. Not when the
    step rescaled ``.grad`` (a clipper's coefficients in ``Reference.scale`` other than 1): the
    check then compares ``scale * sum`` with it, and ``.grad`` is not the sum."""
    c = found.check
    grads, factor = (reference.grads, reference.scale) if isinstance(reference, step_check.Reference) \
        else (reference, None)
    if c is None or grads is None or not _unscaled(factor):
        return
    if not (c.replayed and c.residual <= SAME_STEP and abs(c.norm_ratio - 1.0) <= SAME_STEP
            and c.scale is not None and abs(c.scale - 1.0) <= SAME_STEP):
        return
    total = [r if r is not None and not r.is_sparse and r.dtype == t.dtype and r.shape == t.shape
             and r.device == t.device else t for r, t in zip(grads, stage.total)]
    stage.total = found.hits.total = total
    stage.total_sq = found.hits.total_sq = prober.norm(total) ** 2


def _unscaled(factor) -> bool:
    """Did the step leave ``.grad`` as backward made it? (No factor, or every coefficient 1: the
    monitor passes a clipper's coefficients whenever it ran, clipping or not.)"""
    if factor is None:
        return True
    if isinstance(factor, torch.Tensor):
        return bool((factor == 1).all())  # host sync: once per localization, on a spike
    return float(factor) == 1.0


def _starved(prober: Prober, search: Search, terms: list[list]) -> LocateResult:
    """The budget is smaller than the step's micro-batches (one full-mask probe each)."""
    k = sum(1 for t in terms if t)
    return LocateResult(tokens=[], probes=prober.count, method=search.method, threshold=float("nan"),
                        total_norm=float("nan"), budget_exhausted=True,
                        notes=[f"the probe budget ({prober.budget}) ran out before every micro-batch was probed "
                               f"once ({k} micro-batches with loss terms): raise the budget (locate.budget) to at "
                               f"least {k + 2}; no culprit could be looked for"])


def _result(prober: Prober, stage: MicroBatchStage, search: Search, tau: float, found: Found) -> LocateResult:
    culprits, below, floor_notes = ranked_rows(found.coarse, found.hits.tokens, found.flagged,
                                               prober.budget if found.exhausted else None)
    notes = found.notes + floor_notes
    single = not search.labelled

    def floats(xs: list) -> list:
        return [] if single else [None if x is None else x.float() for x in xs]

    return LocateResult(tokens=[c for c in culprits if c.level == "token"], probes=prober.count,
                        method=search.method, threshold=float(tau), total_norm=stage.total_sq ** 0.5,
                        layer_names=stage.names or [],
                        ghost_map=stage.scores[0].float() if single and stage.scores[0] is not None else None,
                        layer_map=stage.maps[0].float() if single and stage.maps[0] is not None else None,
                        budget_exhausted=found.exhausted, notes=notes, micro_batch_norms=[] if single else stage.norms,
                        ghost_maps=floats(stage.scores), layer_maps=floats(stage.maps), culprits=culprits,
                        step_check=found.check, sample_shares=found.shares, below_floor=below)


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
    maps = [None if m is None else m.to(torch.bfloat16) for m in maps]
    term_score = {}
    for i in range(prober.k):
        if terms[i]:
            vals = scores[i][prober.masks[i].detach().cpu() != 0].tolist()  # host sync: once per micro-batch
            term_score.update(zip(((i, b, t) for b, t in terms[i]), vals))
    return MicroBatchStage(total, total_sq, norms, maps, names or [], scores, term_score, segments)


# each method's token search over ``score``'s terms (the step's, less those of reported samples),
# then the levels' deferred candidates (``levels.reconsider``); ``units.grad``: the gradient of
# what the levels reported (None: nothing); returns (budget_exhausted, notes)
def _auto(prober, stage: MicroBatchStage, score: dict, tau: float, hits: Hits,
          units: levels.Units) -> tuple[bool, list[str]]:
    return auto(prober, hits, list(score), tau, prune_level(score, tau), explained=units.grad,
                then=levels.after_tokens(units))


def _bisect(prober, stage: MicroBatchStage, score: dict, tau: float, hits: Hits,
            units: levels.Units) -> tuple[bool, list[str]]:
    units.track, units.grad = False, None  # no remainder to take: no running sum
    tau_prune = prune_level(score, tau)
    for i in micro_batch_order(stage.norms):
        terms_i = [k[1:] for k in score if k[0] == i]
        # a micro-batch whose gradient is within the bisection rule holds no culprit worth a
        # search (with one micro-batch the root is always split, as it always was)
        if not terms_i or (prober.k > 1 and stage.norms[i] <= tau_prune * math.sqrt(len(terms_i))):
            continue
        if bisect(prober, i, terms_i, tau, hits, two_probes=True, tau_prune=tau_prune):
            return True, []
    exhausted, _ = levels.after_tokens(units)(None)  # the deferred candidates (no running sum to give)
    return exhausted, []


def _ghost(prober, stage: MicroBatchStage, score: dict, tau: float, hits: Hits, units) -> tuple[bool, list[str]]:
    """The ranking itself, no exact confirmation."""
    if not stage.names:  # no layer the map reads: every score 0 would read "spread over the batch" (round 11)
        raise ValueError("locate.method='ghost' ranks by per-layer ghost norms, and this model has no layer the "
                         "ghost map reads (nn.Linear, nn.Embedding, GPT-2's Conv1D): use method='auto' or "
                         "'bisect', which probe exactly")
    idx = {n: j for j, n in enumerate(stage.names)}
    for (i, b, t), s in score.items():
        if s > tau:
            layers = {n: float(stage.maps[i][idx[n], b, t]) for n in stage.names}  # host sync: per ghost token
            hits.tokens.append(CulpritToken(b, t, s, layers, score=s, micro_batch=i if hits.label else None))
    return False, ["ghost: grad_norm and layer_norms are per-position estimates, not exact probes"]


METHOD_SEARCH = {"auto": _auto, "bisect": _bisect, "ghost": _ghost}


def gradloc_search(prober: Prober, terms: list[list], tau: float, labelled: bool,
                   reference: step_check.Reference | list | None = None) -> LocateResult:
    """GradLoc's own procedure (``gradloc.py``): its micro-batch stage, then its token stage; the
    step check costs no probe and changes nothing in the procedure."""
    budget = prober.budget - prober.k
    total, norms, target = gradloc.micro_batch_stage(prober, terms, tau)
    total_sq = prober.norm(total) ** 2
    check_finite(total_sq, norms, total)
    notes: list[str] = []
    check = step_check.check_step(prober, total, reference)
    step_check.report(check, notes)
    stage = MicroBatchStage(total, total_sq, norms, [], [], [], {}, [])
    hits = Hits(prober, total, total_sq, label=labelled)
    _stand_in(prober, stage, Found(hits, check=check), reference)
    del total
    exhausted = False
    if target < 0:
        notes.append("gradloc: no micro-batch above its threshold; no token search")
    else:
        exhausted = gradloc.token_stage(prober, target, terms[target], tau, budget, hits)
    culprits, below, floor_notes = ranked_rows([], hits.tokens, [], prober.budget if exhausted else None)
    return LocateResult(tokens=culprits, probes=prober.count, method="gradloc", threshold=float(tau),
                        total_norm=stage.total_sq ** 0.5, layer_names=list(prober.grouping.layers),
                        budget_exhausted=exhausted, notes=notes + floor_notes,
                        micro_batch_norms=norms if labelled else [],
                        ghost_maps=[None] * prober.k if labelled else [],
                        layer_maps=[None] * prober.k if labelled else [], step_check=check, below_floor=below)


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
