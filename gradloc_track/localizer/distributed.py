"""``locate()`` under ``torch.distributed``: find the rank, micro-batch and token of a spike.

Called collectively on every rank, each with its own ``loss_fn`` and ``token_mask`` (or K of
each for K micro-batches), on a DDP-wrapped or FSDP2 (``fully_shard``) model. Every probe runs
on every rank (``dist_probe.DistProber``), so nothing deadlocks and every probed gradient is the
one the optimizer would see. Methods:

- ``auto`` (default): ONE collective ghost pass gives every rank the ranking of its OWN terms
  (ghost norms are local to each rank's activations); the candidates are all-gathered, ranked
  globally and confirmed with exact single-term probes (every rank runs each; only the owner's
  mask is non-zero), then the remainder ``g_total - sum(g_culprit)`` is checked without a probe.
  About ``m + 2`` probes for ``m`` culprits, independent of the world size.
- ``bisect``: our halving (``search.bisect``) over the global term list (ranks in order).
- ``gradloc``: GradLoc's own path (Tencent-Hunyuan/GradLoc): its micro-batch stage, a
  single-path binary search over ranks (2 probes per split, the larger raw-norm half kept, ties
  right, giving up below its threshold), then its token bisection (``gradloc.token_stage``) inside that one rank. About
  ``K + 2 log2(world) + 2 m log2(N)`` probes; it finds the culprits of one rank only, which is
  why ``auto`` gathers candidates from every rank instead. Needs an explicit ``threshold``.

The single-process searches run unchanged on global terms ``(rank, micro_batch, batch,
position)`` through ``dist_probe.GlobalView`` (they treat terms as opaque), in lockstep.
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
threshold (``None``) is taken over every rank's terms.

Failures. A rank-local failure during the search (``loss_fn`` raising, an OOM copying a probe's
gradient or saving the gradients) is agreed on before the next collective (``dist_failure``):
every rank raises ``LocateAborted`` together, restored, in step with its peers.

The result is identical on every rank; ``CulpritToken.rank`` names the rank whose batch holds
the culprit, ``micro_batch`` its micro-batch when the step had several.
"""
from __future__ import annotations

import math
import time
from functools import partial
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from ..grouping import LayerGrouping
from ..norms import reduce_over_shards, trainable_params
from .dist_failure import aborted, attempt, describe
from .dist_probe import DistProber, DistSnapshot, DistTerm, GlobalHits, GlobalView
from . import levels, step_check
from .ghost import GhostMap, adaptive_threshold
from .gradloc import token_stage
from .inputs import as_micro_batches, check_inputs, rng_states
from .probe import Grads, Prober, restore_rng
from .result import LocateResult
from .search import auto, bisect, prune_level, term_scores
from .segments import Segments

METHODS = ("auto", "bisect", "gradloc")


def is_distributed(group=None) -> bool:
    """True when a process group with more than one rank is initialized."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def _local_problem(model, loss_fn, token_mask, method, budget, threshold) -> tuple[str, list, list, bool]:
    """This rank's input errors as one message ('' when fine), checked before any collective, and
    its micro-batches (empty lists when the inputs could not be read)."""
    if method not in METHODS:
        return f"method={method!r} is not available under torch.distributed: use one of {METHODS}", [], [], False
    try:
        fns, masks, labelled = as_micro_batches(loss_fn, token_mask)
        check_inputs(model, masks, method, budget, threshold)
    except (TypeError, ValueError) as exc:
        return str(exc), [], [], False
    return "", fns, masks, labelled


def _gather(obj, group) -> list:
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def _check_collectively(model, loss_fn, token_mask, method, budget, threshold, group,
                        failure: Exception | None = None) -> tuple[list, list, bool]:
    """Every rank raises the same error, or none does (one all_gather, before any probe).
    ``failure``: what this rank could not do before (saving its gradients): ``LocateAborted``."""
    problem, fns, masks, labelled = _local_problem(model, loss_fn, token_mask, method, budget, threshold)
    mine = (problem, len(fns), sum(int((m != 0).sum()) for m in masks), describe(failure) if failure else "")
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
    return fns, masks, labelled


def _ghost_pass(prober: DistProber, model, group_by: str, world: int):
    """Probe 1, all terms of every rank, with ghost hooks: the total gradient and, per
    micro-batch, THIS rank's (L, B, T) layer map in the optimizer's units (divided by W) and its
    samples with their exact ghost norms (``segments.py``)."""
    segs = [Segments(k, m) for k, m in enumerate(prober.masks)]
    ghosts = {k: GhostMap(model, group_by, tuple(m.shape), segments=segs[k]) for k, m in enumerate(prober.masks)}
    total = prober.run(dict(enumerate(prober.masks)), ghosts=ghosts)
    maps, names = [], prober.grouping.layers
    for g in ghosts.values():
        lm, names = g.result(prober.grouping.layers)
        maps.append(lm / world)
    return total, maps, names, segs


def _check_synchronized(prober: DistProber, total: Grads) -> float:
    """A model without DDP/FSDP2 gives each rank its own gradient: the ranks' searches would then
    diverge. Checked once, on the full gradient's squared norm (identical when synchronized)."""
    sq = float(prober.sq_per_tensor(total).sum())
    every = _gather(sq, prober.group)
    if len(set(every)) > 1:
        raise ValueError(f"the gradient differs across ranks after backward (squared norms {every}): locate() "
                         "under torch.distributed needs the model wrapped in DistributedDataParallel or "
                         "sharded with fully_shard, and loss_fn must run the wrapped model")
    return sq


def _gather_terms(prober: DistProber, maps: list[torch.Tensor] | None,
                  segs: list[Segments] | None = None) -> tuple[dict[DistTerm, float], list]:
    """Every rank's loss terms with their ghost scores (0 without maps), and every rank's samples
    as ``((rank, micro_batch, batch), ghost norm, loss terms)``, in one all_gather."""
    world = dist.get_world_size(prober.group)
    local = []
    for k, mask in enumerate(prober.masks):
        idx = (mask != 0).nonzero().cpu()  # (n, 2)
        scores = term_scores(maps[k], mask) if maps is not None else torch.zeros(mask.shape)  # (B, T)
        norms = segs[k].norms() if segs is not None else None
        samples = [(s.batch, n / world, len(s.terms)) for s, n in zip(segs[k].items, norms)] if norms else []
        local.append((k, idx, scores[idx[:, 0], idx[:, 1]] if len(idx) else torch.zeros(0), samples))
    out: dict[DistTerm, float] = {}
    rows = []
    for r, parts in enumerate(_gather(local, prober.group)):
        for k, idx, vals, samples in parts:
            for (b, t), v in zip(idx.tolist(), vals.tolist()):
                out[(r, k, b, t)] = v
            rows += [((r, k, b), n, m) for b, n, m in samples]
    return out, rows


def _adaptive(score: dict[DistTerm, float], samples: list) -> float:
    """The single-process rule over every rank's terms: candidate samples' terms do not set it."""
    picked = {key for key, _, _ in levels.outliers(samples)[0]}
    inside = {t for t in score if t[:3] in picked}
    pool = levels.ordinary(score, inside)
    return adaptive_threshold(torch.tensor([pool[t] for t in sorted(pool)], dtype=torch.float64))


def _gradloc(prober: DistProber, view: GlobalView, terms: list[DistTerm], threshold: float, budget: int,
             labelled: bool):
    """GradLoc's path (the official ``_micro_batch_search`` -> ``_bisect_rank_search`` ->
    ``_bisect_process``): micro-batch stage, single-path binary search over ranks, token stage.

    ``T = threshold * N / (K * W)`` is GradLoc's per-token knob (``N`` the global term count) and
    ``unit = T * sqrt(K / N) / sqrt(W)``. Micro-batch stage: each micro-batch probed with every
    rank's full mask; the largest RAW norm above ``unit * sqrt(W)`` is kept (ties: the first).
    Rank stage over ranks ``[0, W-1]``: split at ``(l + r) // 2``, both halves probed, the larger
    raw norm kept (ties: the right half), giving up when it is below ``unit * sqrt(its rank
    count)``. Token stage: ``gradloc.token_stage`` over that rank's ``n`` terms at
    ``T / (W * n)`` (GradLoc's ``T / sqrt(s) / W`` on the range's token-mean, in the rank's sum
    units). Returns (total gradient, hits, budget_exhausted).
    """
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
    hits = GlobalHits(view, total, total_sq, {}, labelled)
    if target < 0:
        return total, hits, False
    rank = _gradloc_rank_search(prober, [t for t in terms if t[1] == target], W, unit)
    if rank < 0:
        return total, hits, False
    mine = [t for t in terms if t[1] == target and t[0] == rank]
    return total, hits, token_stage(view, 0, mine, T / (W * len(mine)), budget, hits)


def _gradloc_rank_search(prober: DistProber, terms: list[DistTerm], world: int, unit: float) -> int:
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


def _step_check(prober: DistProber, total: Grads, snap: DistSnapshot, notes: list[str]):
    """The probes' sum against the step's ``.grad`` (as in one process, ``step_check.py``), with
    per-tensor values summed over the ranks that shard them: the same verdict on every rank."""
    check = step_check.check_step(prober, total, snap.grads_for(prober.params),
                              reduce=lambda v: reduce_over_shards(v, prober.params), explain=False)
    step_check.report(check, notes)
    return check


def locate_distributed(model: torch.nn.Module, loss_fn: Callable | Sequence[Callable],
                       token_mask: torch.Tensor | Sequence[torch.Tensor], method: str = "auto",
                       budget: int = 128, threshold: float | None = None, *, group_by: str = "block",
                       rng_state=None, group=None) -> LocateResult:
    """Collective ``locate``: every rank calls it; every rank gets the same culprits.

    ``ghost_map``/``layer_map`` in the result are THIS rank's (its first micro-batch's), the one
    per-rank part of the result; ``dist_context.gather_culprit_rows`` brings the rows the
    artifacts show to rank 0. A failure on one rank (saving its gradients, a probe's ``loss_fn``)
    stops the search on every rank together: all raise ``LocateAborted``, everything restored.
    """
    t0 = time.perf_counter()
    snap, failure = attempt(partial(DistSnapshot, model))  # its copies may not fit: agreed on below
    fns, masks, labelled = _check_collectively(model, loss_fn, token_mask, method, budget, threshold, group, failure)
    try:
        result = _search(model, fns, masks, labelled, method, budget, threshold, group_by, rng_state, group, snap)
    except BaseException:
        snap.recover_fsdp()  # every rank left a forward without its backward: FSDP2 reshards
        raise
    finally:
        snap.restore()
    result.wall_time_s = time.perf_counter() - t0
    return result


def _search(model, fns, masks, labelled: bool, method: str, budget: int, threshold: float | None, group_by: str,
            rng_state, group, snap: DistSnapshot) -> LocateResult:
    """The search itself, in lockstep on every rank (``locate_distributed`` restores afterwards)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    named = trainable_params(model)
    grouping = LayerGrouping.build([n for n, _ in named], group_by)
    rngs = rng_states(rng_state, len(fns), snap.rng)
    # gradloc: its micro-batch and rank stages come on top of the token stage's budget
    extra = len(fns) + 2 * world if method == "gradloc" else 0
    prober = DistProber([p for _, p in named], fns, masks, rngs, budget + extra, grouping, rank, group)
    view = GlobalView(prober)
    tau = threshold / world if threshold is not None else None
    notes: list[str] = []
    maps, names = None, grouping.layers
    if method == "gradloc":
        terms = sorted(_gather_terms(prober, None)[0])
        total, hits, exhausted = _gradloc(prober, view, terms, threshold, budget, labelled)
        total_sq = hits.total_sq
    else:
        total, maps, names, segs = _ghost_pass(prober, model, group_by, world)
        total_sq = _check_synchronized(prober, total)
        score, samples = _gather_terms(prober, maps, segs)
        terms = sorted(score)  # global order: rank, micro-batch, batch, position
        if tau is None:
            tau = _adaptive(score, samples)
        hits = GlobalHits(view, total, total_sq, score, labelled)
        if method == "auto":
            exhausted, notes = auto(view, hits, [(0, *t) for t in terms], tau, prune_level(score, tau))
        else:
            exhausted = bisect(view, 0, terms, tau, hits, two_probes=True, tau_prune=prune_level(score, tau))
    if not math.isfinite(total_sq):
        raise FloatingPointError("the batch's gradient is not finite (NaN/Inf): localization needs finite "
                                 "gradients; skip this step or find the bad sample by its loss first")
    check = _step_check(prober, total, snap, notes)
    tokens = sorted(hits.tokens, key=lambda c: (-c.grad_norm, c.rank, c.micro_batch or 0, c.batch, c.position))
    restore_rng(snap.rng)
    return LocateResult(tokens=tokens, probes=prober.count, method=method, threshold=float(tau),
                        total_norm=total_sq ** 0.5, layer_names=names,
                        ghost_map=term_scores(maps[0], masks[0]).float() if maps else None,
                        layer_map=maps[0].float() if maps else None, budget_exhausted=exhausted, wall_time_s=0.0,
                        notes=notes + [f"distributed over {world} ranks; norms in the optimizer's units "
                                       "(averaged over ranks)"], step_check=check)
