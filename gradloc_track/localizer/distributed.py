"""``locate()`` under ``torch.distributed``: the rank, micro-batch, sample, span and tokens of a spike.

Called collectively on every rank, each with its own step (``step.LocateStep``: its ``loss_fn``
and ``token_mask``, or K of each for K micro-batches, its RNG states and ``document_ids``), on a
DDP-wrapped or FSDP2 (``fully_shard``) model. Every probe runs on every rank
(``dist_probe.DistProber``), so nothing deadlocks and every probed gradient is the one the
optimizer would see.

``auto`` and ``bisect`` give the single-process answer at every level, by the single-process
rules themselves: ONE collective ghost pass (every micro-batch, every rank's full mask) gives each
rank the ghost scores of its OWN terms and the exact ghost norms of its OWN samples (rows, or the
documents ``document_ids`` marks); one ``all_gather_object`` numbers every rank's terms, samples
and micro-batch pieces globally (``dist_terms``); then, on every rank in lockstep, over that
numbering (``dist_probe.GlobalView``):

1. samples and spans: ``levels.candidates`` / ``levels.find_units`` (a sample of any rank that
   stands out of every rank's samples is confirmed with one probe, a span inside it with one more);
2. tokens: ``search.auto`` (candidates from the global ranking confirmed with exact single-term
   probes, the remainder checked without a probe: about ``m + 2`` probes for ``m`` culprits,
   independent of the world size) or ``search.bisect`` (our halving over the global term list);
   the threshold is the single-process one over every rank's ordinary terms;
3. micro-batches: ``levels.micro_batch_units`` over the PIECES (one rank's part of one
   micro-batch: what one forward computed; with one micro-batch, a rank's whole batch), ranked
   by their gradients' norms over the hooked layers, exact, from the same ghost backward
   (``dist_terms.PieceNorm``: one probe per piece would cost W*K); a reported piece is probed;
4. nothing found: ``levels.sample_shares`` over every rank's samples.

Rows are placed back on the rank that holds them: every culprit row names its ``rank``, and
``micro_batch`` (micro-batch rows always; the others when the step had several) and the rank's
own ``batch``; ``document`` for packed documents. The result is identical on every rank.

- ``gradloc``: GradLoc's own path (Tencent-Hunyuan/GradLoc): its micro-batch stage, a
  single-path binary search over ranks (2 probes per split, the larger raw-norm half kept, ties
  right, giving up below its threshold), then its token bisection (``gradloc.token_stage``)
  inside that one rank. About ``K + 2 log2(world) + 2 m log2(N)`` probes; token rows of one rank
  only (as in one process, GradLoc's path reports no samples). Needs an explicit ``threshold``.

A rank that calls ``locate`` while its peers do not waits in the first all-gather (the process
group's timeout applies): call it on every rank, as the monitor does.

Units. DDP and FSDP2 average gradients over the ``W`` data-parallel ranks, so a term's share of
the optimizer's gradient is its own-loss gradient divided by ``W``. Every norm in the result
(``grad_norm``, ``layer_norms``, ``total_norm``, ``threshold``) is in the optimizer's units:
the numbers one process would report for the global batch with a global-mean loss. An explicit
``threshold`` is in the units of one rank's own ``loss_fn`` (what single-process ``locate``
would use with that ``loss_fn``) and is divided by ``W`` here, as GradLoc divides its token
threshold by the world size (``gradloc``: GradLoc's ``T = threshold * N / (K * W)``, ``N`` the
global term count, the same for equal counts per rank; see ``_gradloc``). The adaptive
threshold (``None``) is taken over every rank's terms. ``grad_scale`` (a clipper's per-tensor
coefficients, identical on every rank) scales the probes' sum in the step check, as in one process.

Non-finite steps. When the probes' sum is NaN/Inf on any rank (agreed by the check of the first
probe), every rank runs the non-finite search instead (``dist_nonfinite``): the rank, micro-batch,
sample and tokens that made it so, found by ``isfinite`` of agreed probes, the same on every rank.

Failures. A rank-local failure during the search (``loss_fn`` raising, an OOM copying a probe's
gradient or saving the gradients) is agreed on before the next collective (``dist_failure``):
every rank raises ``LocateAborted`` together, restored, in step with its peers.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Sequence

import torch
import torch.distributed as dist

from ..grouping import LayerGrouping
from ..norms import reduce_over_shards, trainable_params
from . import levels, nonfinite, step_check
from .dist_failure import aborted, attempt, describe
from .dist_flagged import gather_flags, global_flags, name_flagged_everywhere
from .dist_nonfinite import as_result as nonfinite_result
from .dist_probe import DistProber, DistSnapshot, GlobalHits, GlobalView, PieceView
from .dist_terms import GlobalTerms, PieceNorm, gather_terms
from .ghost import GhostMap
from .gradloc import token_stage
from .inputs import SearchOptions, check_inputs
from .nonfinite import NonfiniteStep
from .probe import Grads, Prober, restore_rng
from .result import LocateResult, ranked_rows
from .search import adaptive_tau, auto, bisect, prune_level, term_scores
from .segments import Segments
from .step import LocateStep
from .step_check import Reference

METHODS = ("auto", "bisect", "gradloc")


@dataclass
class _Inputs:
    """This rank's step, read and checked: its micro-batches, documents and ``.grad`` scale."""

    fns: list
    masks: list
    labelled: bool
    docs: list | None
    scale: torch.Tensor | float | None
    note: str | None


@dataclass
class _Found:
    """What a search found: the step's gradient, the culprit rows at every level, the threshold."""

    total: Grads
    total_sq: float
    hits: GlobalHits
    tau: float
    exhausted: bool
    coarse: list = field(default_factory=list)
    shares: list = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    maps: list[torch.Tensor] | None = None
    names: list[str] | None = None
    flagged: list = field(default_factory=list)  # rows named for what a data signal saw (``dist_flagged``)


def _local_problem(model, step: LocateStep, options: SearchOptions) -> tuple[str, _Inputs | None]:
    """This rank's input errors as one message ('' when fine), checked before any collective, and
    its inputs (None when they could not be read)."""
    if options.method not in METHODS:
        return f"method={options.method!r} is not available under torch.distributed: use one of {METHODS}", None
    try:
        fns, masks, labelled = step.micro_batches()
        check_inputs(model, masks, options.method, options.budget, options.threshold)
        docs = step.documents(masks)
        scale = step.scale_for(len(trainable_params(model)))
        note = step.note()
    except (TypeError, ValueError) as exc:
        return str(exc), None
    return "", _Inputs(fns, masks, labelled, docs, scale, note)


def _gather(obj, group) -> list:
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def _check_collectively(model, step: LocateStep, options: SearchOptions, group,
                        failure: Exception | None = None) -> _Inputs:
    """Every rank raises the same error, or none does (one all_gather, before any probe).
    ``failure``: what this rank could not do before (saving its gradients): ``LocateAborted``."""
    problem, inputs = _local_problem(model, step, options)
    n_terms = sum(int((m != 0).sum()) for m in inputs.masks) if inputs else 0  # host sync: once, before probing
    mine = (problem, len(inputs.fns) if inputs else 0, n_terms, describe(failure) if failure else "")
    every = _gather(mine, group)
    failed = [f"rank {r}: {f}" for r, (_, _, _, f) in enumerate(every) if f]
    if failed:
        raise aborted("saving the gradients", failed) from failure
    errors = [f"rank {r}: {e}" for r, (e, _, _, _) in enumerate(every) if e]
    if errors:
        raise ValueError("; ".join(errors))
    ks = {k for _, k, _, _ in every}
    if len(ks) > 1:
        raise ValueError(f"every rank must pass the same number of micro-batches (got {[e[1] for e in every]} "
                         "per rank): a DDP/FSDP2 step runs one backward per micro-batch on every rank")
    if sum(e[2] for e in every) == 0:
        raise ValueError("token_mask selects no loss terms on any rank (all zeros): pass the batch's loss mask")
    return inputs


def _ghost_pass(prober: DistProber, model, group_by: str, docs: list | None):
    """Probe 1, all terms of every rank, with ghost hooks: the total gradient and, per
    micro-batch, THIS rank's (L, B, T) layer map in the optimizer's units (divided by W), its
    samples (rows, or packed documents) with their exact ghost norms (``segments.py``) and its
    piece's (``dist_terms.PieceNorm``)."""
    world = dist.get_world_size(prober.group)
    docs = docs or [None] * prober.k
    pieces = [PieceNorm(Segments(k, m, docs[k])) for k, m in enumerate(prober.masks)]
    ghosts = {k: GhostMap(model, group_by, tuple(m.shape), segments=pieces[k]) for k, m in enumerate(prober.masks)}
    total = prober.run(dict(enumerate(prober.masks)), ghosts=ghosts)
    maps, names = [], prober.grouping.layers
    for g in ghosts.values():
        lm, names = g.result(prober.grouping.layers)
        maps.append(lm / world)
    return total, maps, names, pieces


def _check_synchronized(prober: DistProber, total: Grads) -> float:
    """A model without DDP/FSDP2 gives each rank its own gradient: the ranks' searches would then
    diverge. Checked once, on the full gradient's squared norm (identical when synchronized); a
    non-finite gradient sends every rank alike to the non-finite search (``NonfiniteStep``)."""
    sq = float(prober.sq_per_tensor(total).sum())  # host sync: once per localization
    every = _gather(sq, prober.group)
    if not all(math.isfinite(v) for v in every):
        raise NonfiniteStep([], total)
    if len(set(every)) > 1:
        raise ValueError(f"the gradient differs across ranks after backward (squared norms {every}): locate() "
                         "under torch.distributed needs the model wrapped in DistributedDataParallel or "
                         "sharded with fully_shard, and loss_fn must run the wrapped model")
    return sq


def _levels(prober: DistProber, model, inp: _Inputs, options: SearchOptions, flagged: Sequence = ()) -> _Found:
    """``auto`` / ``bisect``: samples and spans, tokens, micro-batch pieces, or the per-sample
    shares, by the single-process rules over every rank's terms (module doc, steps 1-4); then the
    units any rank's data signals flagged (``dist_flagged``)."""
    world = dist.get_world_size(prober.group)
    total, maps, names, pieces = _ghost_pass(prober, model, options.group_by, inp.docs)
    total_sq = _check_synchronized(prober, total)
    glob = gather_terms(prober, maps, pieces)
    every_flag = gather_flags(flagged, prober.group)  # a collective: every rank, flags or not
    # only data signals fired (``driver``): the flagged units are the answer; the same on every rank (gathered)
    alone = any(getattr(f, "alone", False) for flags in every_flag for f in flags)
    view = GlobalView(prober, glob)
    segments = glob.segments if len(glob.segments) >= 2 and not alone else None  # one sample: nothing to compare
    cands, limit, n_samples = levels.candidates([segments])
    inside = {(seg.micro_batch, b, t) for seg, _ in cands for b, t in seg.terms}
    tau = options.threshold / world if options.threshold is not None else \
        adaptive_tau(levels.ordinary(glob.score, inside))
    hits = GlobalHits(view, total, total_sq, glob.score, inp.labelled)
    units = levels.find_units(view, hits, cands, limit, glob.score, tau, inp.labelled, n_samples)
    found = _Found(total, total_sq, hits, tau, units.exhausted, maps=maps, names=names,
                   coarse=[glob.place(c, inp.labelled) for c in units.culprits])
    rows = list(units.culprits)  # the coarse rows in the search's numbering (the flags' overlap check reads them)
    whole: set = set()  # the (rank, micro-batch) pieces named whole
    if not found.exhausted and not alone:
        found.exhausted, found.notes = _tokens(view, hits, glob, units, options.method, tau)
    if not found.exhausted and not alone:
        holding = {glob.piece_of(c) for c in found.coarse + hits.tokens}
        pieces = levels.micro_batch_units(PieceView(prober, glob), hits, glob.piece_norms, glob.piece_terms,
                                          holding, True)
        whole = {glob.pieces[c.micro_batch] for c in pieces}
        found.coarse += [glob.place_piece(c) for c in pieces]
    if not found.exhausted and not found.coarse and not hits.tokens and not alone:  # a budget that ran out says so
        shares, named = levels.sample_shares(view, hits, [glob.segments], True)
        found.shares = [glob.place_share(r, inp.labelled) for r in shares]
        found.coarse += [glob.place(c, inp.labelled) for c in named]
        rows += named
        if not named:
            found.notes.append(levels.no_culprit_note(found.shares, len(glob.segments)))
    if not found.exhausted and any(every_flag):
        found.flagged, more = name_flagged_everywhere(view, hits, glob, global_flags(every_flag, glob, whole),
                                                      rows, inp.labelled)
        found.notes += more
    return found


def _tokens(view: GlobalView, hits: GlobalHits, glob: GlobalTerms, units: levels.Units, method: str,
            tau: float) -> tuple[bool, list[str]]:
    """The token search over the terms the reported samples left (their gradient left too), then
    the levels' deferred candidates (``levels.reconsider``), as ``driver._auto`` / ``_bisect``."""
    score = {k: v for k, v in glob.score.items() if k not in units.excluded}

    then = levels.after_tokens(units)
    if method == "auto":
        return auto(view, hits, list(score), tau, prune_level(score, tau), explained=units.grad, then=then)
    units.track, units.grad = False, None  # bisect takes no remainder: no running sum
    if bisect(view, 0, [k[1:] for k in score], tau, hits, two_probes=True, tau_prune=prune_level(score, tau)):
        return True, []
    then(None)
    return units.exhausted, []


def _gradloc(prober: DistProber, threshold: float, budget: int, labelled: bool) -> _Found:
    """GradLoc's path (the official ``_micro_batch_search`` -> ``_bisect_rank_search`` ->
    ``_bisect_process``): micro-batch stage, single-path binary search over ranks, token stage.

    ``T = threshold * N / (K * W)`` is GradLoc's per-token knob (``N`` the global term count) and
    ``unit = T * sqrt(K / N) / sqrt(W)``. Micro-batch stage: each micro-batch probed with every
    rank's full mask; the largest RAW norm above ``unit * sqrt(W)`` is kept (ties: the first).
    Rank stage over ranks ``[0, W-1]``: split at ``(l + r) // 2``, both halves probed, the larger
    raw norm kept (ties: the right half), giving up when it is below ``unit * sqrt(its rank
    count)``. Token stage: ``gradloc.token_stage`` over that rank's ``n`` terms at
    ``T / (W * n)`` (GradLoc's ``T / sqrt(s) / W`` on the range's token-mean, in the rank's sum
    units).
    """
    glob = gather_terms(prober, None, None)
    terms = glob.dist_terms()
    K, W, N = prober.k, dist.get_world_size(prober.group), len(terms)
    T = threshold * N / (K * W)
    unit = T * math.sqrt(K / N) / math.sqrt(W)
    total, target, best = None, -1, 0.0
    for k in range(K):
        if not any(t[1] == k for t in terms):
            continue
        g = prober.run({k: prober.masks[k]})
        v = prober.norm(g)
        total = g if total is None else Prober.add_(total, g)
        if v > unit * math.sqrt(W) and v > best:
            best, target = v, k
    total_sq = _check_synchronized(prober, total)
    view = GlobalView(prober, glob)
    found = _Found(total, total_sq, GlobalHits(view, total, total_sq, {}, labelled), threshold / W, False,
                   names=list(prober.grouping.layers))
    rank = -1 if target < 0 else _gradloc_rank_search(prober, [t for t in terms if t[1] == target], W, unit)
    if rank >= 0:
        mine = [glob.of_dist(t) for t in terms if t[1] == target and t[0] == rank]
        found.exhausted = token_stage(view, 0, mine, T / (W * len(mine)), budget, found.hits)
    return found


def _gradloc_rank_search(prober: DistProber, terms: list, world: int, unit: float) -> int:
    """The rank holding the spike by GradLoc's single-path halving over ``[0, world-1]``, or -1
    when the larger half is below ``unit * sqrt(its rank count)`` (raw norms: each rank's loss is
    its own token-mean, so the ranks' norms compare as GradLoc's do; ties go right)."""
    lo, hi = 0, world - 1
    while lo < hi:
        mid = (lo + hi) // 2
        left = prober.norm(prober.probe_global([t for t in terms if lo <= t[0] <= mid]))
        right = prober.norm(prober.probe_global([t for t in terms if mid < t[0] <= hi]))
        value, size, (lo, hi) = (left, mid - lo + 1, (lo, mid)) if left > right else (right, hi - mid, (mid + 1, hi))
        if value < unit * math.sqrt(size):
            return -1
    return lo


def locate_distributed(model: torch.nn.Module, step: LocateStep, options: SearchOptions,
                       group=None) -> LocateResult:
    """Collective ``locate``: every rank calls it with its own step; every rank gets the same culprits.

    ``ghost_map``/``layer_map`` in the result are THIS rank's (its first micro-batch's), the one
    per-rank part of the result; ``dist_context.gather_culprit_rows`` brings the rows the
    artifacts show to rank 0. A failure on one rank (saving its gradients, a probe's ``loss_fn``)
    stops the search on every rank together: all raise ``LocateAborted``, everything restored.
    """
    t0 = time.perf_counter()
    snap, failure = attempt(partial(DistSnapshot, model))  # its copies may not fit: agreed on below
    inp = _check_collectively(model, step, options, group, failure)
    try:
        result = _search(model, step, inp, options, group, snap)
    except BaseException:
        snap.recover_fsdp()  # every rank left a forward without its backward: FSDP2 reshards
        raise
    finally:
        snap.restore()
    result.wall_time_s = time.perf_counter() - t0
    return result


def _search(model, step: LocateStep, inp: _Inputs, options: SearchOptions, group,
            snap: DistSnapshot) -> LocateResult:
    """The search itself, in lockstep on every rank (``locate_distributed`` restores afterwards)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    named = trainable_params(model)
    grouping = LayerGrouping.build([n for n, _ in named], options.group_by)
    rngs = step.rng_states(len(inp.fns), snap.rng)
    # gradloc: its micro-batch and rank stages come on top of the token stage's budget
    extra = len(inp.fns) + 2 * world if options.method == "gradloc" else 0
    prober = DistProber([p for _, p in named], inp.fns, inp.masks, rngs, options.budget + extra, grouping, rank,
                        group)
    try:
        if options.method == "gradloc":
            found = _gradloc(prober, options.threshold, options.budget, inp.labelled)
        else:
            found = _levels(prober, model, inp, options, tuple(step.flagged))
    except NonfiniteStep as step_nf:  # NaN/Inf on any rank: which samples, by isfinite, on every rank alike
        result = nonfinite_result(prober, step_nf.total, options.method, inp.labelled, inp.docs, grouping.names)
        restore_rng(snap.rng)
        return result
    notes = found.notes
    reference = Reference(snap.grads_for(prober.params), inp.scale, reduced=step.precision is not None)
    check = step_check.check_step(prober, found.total, reference,
                                  reduce=lambda v: reduce_over_shards(v, prober.params), explain=False)
    step_check.report(check, notes)
    restore_rng(snap.rng)
    result = _result(found, options.method, (prober.count, prober.budget), inp, world, check)
    nonfinite.attach_replay(result, reference.grads, grouping.names, step.precision, distributed=True,
                            group=group, device=prober.device)  # a collective
    return result


def _result(found: _Found, method: str, probes: tuple[int, int], inp: _Inputs, world: int, check) -> LocateResult:
    """``probes``: (probes used, the budget)."""
    probes, budget = probes
    culprits, below, floor_notes = ranked_rows(found.coarse, found.hits.tokens, found.flagged,
                                               budget if found.exhausted else None)
    tokens = [c for c in culprits if c.level == "token"]
    notes = found.notes + floor_notes + ([inp.note] if inp.note else []) + [
        f"distributed over {world} ranks; norms in the optimizer's units (averaged over ranks)"]
    maps = found.maps
    return LocateResult(tokens=tokens, probes=probes, method=method, threshold=float(found.tau),
                        total_norm=found.total_sq ** 0.5, layer_names=found.names or [],
                        ghost_map=term_scores(maps[0], inp.masks[0]).float() if maps else None,
                        layer_map=maps[0].float() if maps else None, budget_exhausted=found.exhausted,
                        wall_time_s=0.0, notes=notes, culprits=culprits, step_check=check,
                        sample_shares=found.shares, below_floor=below)
