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
- ``bisect``: GradLoc's depth-first halving over the global term list (ranks in order).
- ``gradloc``: GradLoc's own path (Tencent-Hunyuan/GradLoc): a single-path binary search over
  ranks (2 probes per split, keep the larger half), then token bisection inside that one rank,
  pruning at the threshold itself. About ``2 log2(world) + 2 m log2(N)`` probes; it finds
  culprits of one rank only, which is why ``auto`` gathers candidates from every rank instead.

Units. DDP and FSDP2 average gradients over the ``W`` data-parallel ranks, so a term's share of
the optimizer's gradient is its own-loss gradient divided by ``W``. Every norm in the result
(``grad_norm``, ``layer_norms``, ``total_norm``, ``threshold``) is in the optimizer's units:
the numbers one process would report for the global batch with a global-mean loss. An explicit
``threshold`` is in the units of one rank's own ``loss_fn`` (what single-process ``locate``
would use with that ``loss_fn``) and is divided by ``W`` here, as GradLoc divides its token
threshold by the world size. The adaptive threshold (``None``) is taken over every rank's terms.

The result is identical on every rank; ``CulpritToken.rank`` names the rank whose batch holds
the culprit, ``micro_batch`` its micro-batch when the step had several.
"""
from __future__ import annotations

import math
import time
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from ..grouping import LayerGrouping
from ..norms import trainable_params
from .dist_probe import DistProber, DistSnapshot, DistTerm
from .ghost import GhostMap, adaptive_threshold
from .probe import BudgetExhausted, Grads, restore_rng
from .result import CulpritToken, LocateResult
from .search import bisect, prune_level, term_scores

METHODS = ("auto", "bisect", "gradloc")


def is_distributed(group=None) -> bool:
    """True when a process group with more than one rank is initialized."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def _as_lists(loss_fn, token_mask) -> tuple[list, list]:
    if callable(loss_fn) and isinstance(token_mask, torch.Tensor):
        return [loss_fn], [token_mask]
    fns = list(loss_fn) if not callable(loss_fn) else [loss_fn]
    masks = list(token_mask) if not isinstance(token_mask, torch.Tensor) else [token_mask]
    return fns, masks


def _local_problem(model, fns, masks, method, budget, threshold) -> str:
    """This rank's input errors as one message ('' when fine); checked before any collective."""
    if method not in METHODS:
        return f"method={method!r} is unknown under torch.distributed: use one of {METHODS}"
    if not isinstance(budget, int) or budget < 1:
        return f"budget={budget!r} must be a positive number of probes (e.g. 128)"
    if threshold is not None and not threshold > 0:
        return f"threshold={threshold!r} must be positive, or None for an adaptive threshold"
    if len(fns) != len(masks) or not fns:
        return (f"loss_fn and token_mask must pair up: got {len(fns)} loss function(s) and {len(masks)} "
                "mask(s) (one of each per micro-batch)")
    for k, (fn, m) in enumerate(zip(fns, masks)):
        if not callable(fn):
            return f"loss_fn[{k}] must be callable: loss_fn(mask) -> scalar loss over the kept loss terms"
        if not isinstance(m, torch.Tensor) or m.dim() != 2 or not m.is_floating_point():
            got = f"{tuple(m.shape)} {m.dtype}" if isinstance(m, torch.Tensor) else type(m).__name__
            return f"token_mask[{k}] must be a 2-D (batch, position) floating-point tensor; got {got}"
    if not trainable_params(model):
        return "the model has no parameters with requires_grad=True: nothing to localize"
    return ""


def _gather(obj, group) -> list:
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def _check_collectively(model, fns, masks, method, budget, threshold, group) -> None:
    """Every rank raises the same error, or none does (one all_gather, before any probe)."""
    mine = (_local_problem(model, fns, masks, method, budget, threshold), len(fns),
            sum(int((m != 0).sum()) for m in masks) if all(isinstance(m, torch.Tensor) for m in masks) else 0)
    every = _gather(mine, group)
    errors = [f"rank {r}: {e}" for r, (e, _, _) in enumerate(every) if e]
    if errors:
        raise ValueError("; ".join(errors))
    ks = {k for _, k, _ in every}
    if len(ks) > 1:
        raise ValueError(f"every rank must pass the same number of micro-batches (got {[k for _, k, _ in every]} "
                         "per rank): a DDP/FSDP2 step runs one backward per micro-batch on every rank")
    if sum(n for _, _, n in every) == 0:
        raise ValueError("token_mask selects no loss terms on any rank (all zeros): pass the batch's loss mask")


def _ghost_pass(prober: DistProber, model, group_by: str, world: int):
    """Probe 1, all terms of every rank, with ghost hooks: the total gradient and, per
    micro-batch, THIS rank's (L, B, T) layer map in the optimizer's units (divided by W)."""
    ghosts = [GhostMap(model, group_by, tuple(m.shape)) for m in prober.masks]
    total = prober.probe(prober.masks, ghosts=ghosts)
    maps, names = [], None
    for g in ghosts:
        lm, names = g.result(prober.grouping.layers)
        maps.append(lm / world)
    return total, maps, names


def _check_synchronized(prober: DistProber, total: Grads) -> None:
    """A model without DDP/FSDP2 gives each rank its own gradient: the ranks' searches would then
    diverge. Checked once, on the full gradient's squared norm (identical when synchronized)."""
    sq = float(prober.sq_per_tensor(total).sum())
    every = _gather(sq, prober.group)
    if len(set(every)) > 1:
        raise ValueError(f"the gradient differs across ranks after backward (squared norms {every}): locate() "
                         "under torch.distributed needs the model wrapped in DistributedDataParallel or "
                         "sharded with fully_shard, and loss_fn must run the wrapped model")


def _gather_scores(prober: DistProber, maps: list[torch.Tensor]) -> dict[DistTerm, float]:
    """Every rank's per-term ghost scores, in one all_gather: {(rank, k, b, t): score}."""
    local = []
    for k, (lm, mask) in enumerate(zip(maps, prober.masks)):
        scores = term_scores(lm, mask)  # (B, T)
        idx = (mask != 0).nonzero().cpu()  # (n, 2)
        local.append((k, idx, scores[idx[:, 0], idx[:, 1]] if len(idx) else torch.zeros(0)))
    out: dict[DistTerm, float] = {}
    for r, parts in enumerate(_gather(local, prober.group)):
        for k, idx, vals in parts:
            for (b, t), v in zip(idx.tolist(), vals.tolist()):
                out[(r, k, b, t)] = v
    return out


def _culprit(prober: DistProber, term: DistTerm, g: Grads, total: Grads, total_sq: float, score,
             several: bool) -> CulpritToken:
    share = prober.dot(g, total) / total_sq if total_sq > 0 else None
    c = CulpritToken(batch=term[2], position=term[3], grad_norm=prober.norm(g), layer_norms=prober.layer_norms(g),
                     score=score, share=share, micro_batch=term[1] if several else None, rank=term[0])
    return c


def _auto(prober: DistProber, terms: list[DistTerm], score: dict, tau: float, tau_prune: float, total: Grads):
    """Confirm the globally ranked candidates, then check (and if needed search) the remainder."""
    found: list[tuple[DistTerm, Grads]] = []
    notes: list[str] = []
    for t in sorted(terms, key=lambda t: (-score[t], t)):  # same order on every rank
        if score[t] < tau / 4:
            break
        try:
            g = prober.probe_terms([t])
        except BudgetExhausted:
            return found, True, notes
        if prober.norm(g) > tau:
            found.append((t, g))
        else:
            break
    rest = [t for t in terms if t not in {f for f, _ in found}]
    g_rest = total
    for _, g in found:
        g_rest = prober.sub(g_rest, g)
    exhausted = False
    if rest and prober.norm(g_rest) > tau_prune * math.sqrt(len(rest)):
        notes.append("ranking left a remainder above the bisection bound; searched it by bisection")
        more, exhausted = bisect(prober, rest, tau, known=g_rest, two_probes=False, tau_prune=tau_prune)
        found += more
    return found, exhausted, notes


def _gradloc(prober: DistProber, terms: list[DistTerm], tau: float, world: int):
    """GradLoc's path: single-path binary search over ranks, then token bisection in that rank.

    Each split probes both halves (2 probes) and keeps the larger, as the official code does;
    the token stage prunes at the threshold itself (``tau * sqrt(|S|)``) and, the rank's terms
    being probed alone, compares against the threshold divided by the world size — built into
    ``tau`` here (see the module docstring on units).
    """
    ranks = list(range(world))
    try:
        while len(ranks) > 1:
            left, right = ranks[: (len(ranks) + 1) // 2], ranks[(len(ranks) + 1) // 2:]
            n_left = prober.norm(prober.probe_terms([t for t in terms if t[0] in left]))
            n_right = prober.norm(prober.probe_terms([t for t in terms if t[0] in right]))
            ranks = left if n_left >= n_right else right
    except BudgetExhausted:
        return [], True
    mine = [t for t in terms if t[0] == ranks[0]]
    return bisect(prober, mine, tau, two_probes=True, tau_prune=tau)


def locate_distributed(model: torch.nn.Module, loss_fn: Callable | Sequence[Callable],
                       token_mask: torch.Tensor | Sequence[torch.Tensor], method: str = "auto",
                       budget: int = 128, threshold: float | None = None, *, group_by: str = "block",
                       rng_state: dict | torch.Tensor | None = None, group=None) -> LocateResult:
    """Collective ``locate``: every rank calls it; every rank gets the same ``LocateResult``.

    ``ghost_map``/``layer_map`` in the result are THIS rank's (its first micro-batch's), the one
    per-rank part of the result; the artifact writer gathers the rows it shows.
    """
    fns, masks = _as_lists(loss_fn, token_mask)
    _check_collectively(model, fns, masks, method, budget, threshold, group)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    several = len(fns) > 1
    t0 = time.perf_counter()
    snap = DistSnapshot(model)
    try:
        named = trainable_params(model)
        grouping = LayerGrouping.build([n for n, _ in named], group_by)
        replay = snap.rng if rng_state is None else (
            {"cpu": rng_state} if isinstance(rng_state, torch.Tensor) else rng_state)
        prober = DistProber([p for _, p in named], fns, masks, replay, budget, grouping, rank, group)
        total, maps, names = _ghost_pass(prober, model, group_by, world)
        _check_synchronized(prober, total)
        score = _gather_scores(prober, maps)
        terms = sorted(score)  # global order: rank, micro-batch, batch, position
        explicit = threshold is not None
        tau = threshold / world if explicit else adaptive_threshold(torch.tensor([score[t] for t in terms]))
        notes: list[str] = []
        if method == "auto":
            found, exhausted, notes = _auto(prober, terms, score, tau, prune_level(score, tau, explicit), total)
        elif method == "bisect":
            found, exhausted = bisect(prober, terms, tau, two_probes=True,
                                      tau_prune=prune_level(score, tau, explicit))
        else:
            found, exhausted = _gradloc(prober, terms, tau, world)
        total_sq = prober.norm(total) ** 2
        if not math.isfinite(total_sq):
            raise FloatingPointError("the batch's gradient is not finite (NaN/Inf): localization needs finite "
                                     "gradients; skip this step or find the bad sample by its loss first")
        tokens = [_culprit(prober, t, g, total, total_sq, score.get(t), several) for t, g in found]
        tokens.sort(key=lambda c: (-c.grad_norm, c.rank, c.micro_batch or 0, c.batch, c.position))
        restore_rng(snap.rng)
        return LocateResult(tokens=tokens, probes=prober.count, method=method, threshold=float(tau),
                            total_norm=total_sq ** 0.5, layer_names=names,
                            ghost_map=term_scores(maps[0], masks[0]).float(), layer_map=maps[0].float(),
                            budget_exhausted=exhausted, wall_time_s=time.perf_counter() - t0,
                            notes=notes + [f"distributed over {world} ranks; norms in the optimizer's units "
                                           "(averaged over ranks)"])
    finally:
        snap.restore()
