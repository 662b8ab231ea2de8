"""Lockstep probes across processes (DDP, FSDP2), and a snapshot that restores every rank.

A probe is a collective: DDP all-reduces gradients in backward and FSDP2 all-gathers parameters
in forward and reduce-scatters gradients in backward. So EVERY rank runs every probe, each with
its own share of the probed subset of loss terms; a rank that owns none of them runs the same
forward/backward with a zero mask (same graph, zero gradient), so the collectives match.
Terms are global: ``(rank, micro_batch, batch, position)`` here, numbered ``(row, t)`` for the
single-process searches and level rules (``dist_terms``, ``GlobalView``).

The gradient a probe returns is the one the optimizer would see: DDP and FSDP2 AVERAGE over the
data-parallel ranks, so a term's gradient is its own-loss gradient divided by the world size.
Norms are taken over the full gradient: sharded (DTensor) parts are summed over exactly the mesh
dims that shard them (``norms.reduce_over_shards``), so every rank computes the same numbers in
the same order and takes the same branch of the search.

A rank-local failure inside a probe (``loss_fn`` raising, an OOM copying the gradient) is agreed
on before the next collective, so every rank leaves the search together (``dist_failure``).
"""
from __future__ import annotations

from functools import partial
from typing import Callable, Sequence

import torch

from ..grouping import LayerGrouping
from ..norms import local_part, reduce_over_shards
from .dist_failure import agree, attempt
from .dist_terms import DistTerm, GlobalTerms
from .probe import BudgetExhausted, Grads, Prober, check_loss, restore_rng, save_rng
from .search import Hits


class DistProber(Prober):
    """The single-process ``Prober`` over global terms: every probe runs on every rank.

    A probe of a global subset runs, on every rank, the micro-batches that hold any of its terms
    (the same ones everywhere: every rank knows the global term list), each with this rank's
    share of the mask (zeros where it owns none), and returns this rank's LOCAL gradient parts.
    """

    def __init__(self, params: Sequence[torch.nn.Parameter], loss_fns: Sequence[Callable],
                 masks: Sequence[torch.Tensor], rng_states: Sequence[dict], budget: int, grouping: LayerGrouping,
                 rank: int, group=None) -> None:
        super().__init__(params, loss_fns, masks, rng_states, budget, grouping)
        self.rank, self.group = rank, group
        # where the failure flag lives: the backend's device (NCCL reduces CUDA tensors only)
        self.device = local_part(self.params[0]).device if self.params else torch.device("cpu")

    def global_mask_of(self, k: int, terms: Sequence[DistTerm]) -> torch.Tensor:
        """This rank's mask of micro-batch ``k`` for a global subset (zeros where it owns none)."""
        return self.mask_of(k, [(b, t) for r, kk, b, t in terms if r == self.rank and kk == k])

    def probe_global(self, terms: Sequence[DistTerm]) -> Grads:
        ks = sorted({t[1] for t in terms})
        return self.run({k: self.global_mask_of(k, terms) for k in ks})

    def run(self, masks: dict[int, torch.Tensor], ghosts: dict | None = None) -> Grads:
        """The summed gradient of micro-batches ``masks`` (k -> this rank's mask), in lockstep.

        ``ghosts``: k -> a ``GhostMap`` entered around that micro-batch's forward+backward.
        A rank-local failure (``loss_fn`` raising, an unusable loss, the gradient copy) is agreed
        on before the next collective (``dist_failure``): every rank raises together.
        """
        if self.count >= self.budget:  # the count is the same on every rank: all stop together
            raise BudgetExhausted
        self.count += 1
        for p in self.params:
            p.grad = None
        for k, mask in masks.items():
            restore_rng(self.rng_states[k])
            ghost = (ghosts or {}).get(k)
            if ghost is not None:
                ghost.__enter__()
            try:
                loss, failure = attempt(partial(self.loss_fns[k], mask))
                problem = "" if failure is not None else _loss_problem(loss)
                # before backward's collectives (DDP all-reduce, FSDP2 reduce-scatter)
                agree(f"probe {self.count}, micro-batch {k}", self.device, self.group, failure, problem)
                loss.backward()
            finally:
                if ghost is not None:
                    ghost.__exit__(None, None, None)
        out, failure = attempt(self._take_grads)
        agree(f"probe {self.count}, copying its gradient", self.device, self.group, failure)
        return out

    def _take_grads(self) -> Grads:
        # copies: DDP's bucket-view grads are overwritten in place by the next probe
        out = [local_part(p.grad).detach().clone() if p.grad is not None else torch.zeros_like(local_part(p))
               for p in self.params]
        for p in self.params:
            p.grad = None
        return out

    # -- full-gradient vector helpers: local parts, reduced over the ranks that shard them ------
    def sq_per_tensor(self, g: Grads) -> torch.Tensor:  # type: ignore[override]
        return reduce_over_shards(Prober.sq_per_tensor(g), self.params)

    def dot(self, a: Grads, b: Grads) -> float:  # type: ignore[override]
        local = torch.stack([torch.dot(x.reshape(-1).double(), y.reshape(-1).double()) for x, y in zip(a, b)])
        return float(reduce_over_shards(local, self.params).sum())


def _loss_problem(loss) -> str:
    """Why ``loss`` cannot be back-propagated ('' when it can); checked on the host, no sync."""
    try:
        check_loss(loss)
    except TypeError as exc:
        return str(exc)
    return "" if loss.requires_grad else ("loss_fn(mask) returned a loss that does not require grad (also "
                                          "needed for an all-zero mask)")


class GlobalView:
    """The ``DistProber`` as the single-process searches and level rules see a prober: ONE
    micro-batch whose terms are the global ``(row, t)`` of ``dist_terms.GlobalTerms`` (every rank's
    rows, numbered), so ``search.auto``, ``search.bisect``, ``gradloc.token_stage``,
    ``levels.find_units`` and ``levels.sample_shares`` run unchanged, in lockstep, on every rank."""

    k = 1

    def __init__(self, prober: DistProber, terms: GlobalTerms) -> None:
        self.dist, self.terms = prober, terms

    @property
    def count(self) -> int:
        return self.dist.count

    def probe_terms(self, i: int, terms: Sequence[tuple[int, int]]) -> Grads:
        return self.dist.probe_global(self.terms.to_dist(terms))

    def norm(self, g: Grads) -> float:
        return self.dist.norm(g)

    def layer_norms(self, g: Grads) -> dict[str, float]:
        return self.dist.layer_norms(g)

    def dot(self, a: Grads, b: Grads) -> float:
        return self.dist.dot(a, b)

    sub_ = staticmethod(Prober.sub_)
    add_ = staticmethod(Prober.add_)


class PieceView(GlobalView):
    """The pieces (one rank's part of one micro-batch, ``(rank, micro_batch)``) as the micro-batches
    of a prober, for ``levels.micro_batch_units``: ``probe(j, _)`` probes piece ``j``'s terms."""

    def __init__(self, prober: DistProber, terms: GlobalTerms) -> None:
        super().__init__(prober, terms)
        self.k = len(terms.pieces)
        self.masks = [None] * self.k  # the rule hands a piece's mask back to ``probe``: the piece is enough

    def probe(self, j: int, mask=None) -> Grads:
        return self.probe_terms(0, self.terms.piece_terms[j])


class GlobalHits(Hits):
    """``search.Hits`` over global terms: each culprit token summarised when found, placed on its
    rank, micro-batch and row (``GlobalTerms.place``)."""

    def add(self, i: int, term: tuple[int, int], g: Grads, grad_norm: float | None = None) -> None:
        super().add(i, term, g, grad_norm)
        self.tokens[-1] = self.prober.terms.place(self.tokens[-1], self.label)


class DistSnapshot:
    """What localization touches, saved and restored on THIS rank, bitwise.

    Gradients are restored INTO the original tensor objects (DDP's ``gradient_as_bucket_view``
    grads are views of its buckets, which probes overwrite; FSDP2's grads are sharded DTensors),
    so the objects the optimizer and DDP hold stay the same. Also: buffers (DDP's broadcast
    overwrites them with rank 0's in each forward), RNG, train/eval modes, requires_grad.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.params = list(model.parameters())
        self.grads = [p.grad for p in self.params]
        self.saved = [None if g is None else local_part(g).detach().clone() for g in self.grads]
        self.requires_grad = [p.requires_grad for p in self.params]
        self.buffers = [(b, local_part(b).detach().clone()) for b in model.buffers()]
        self.modes = {m: m.training for m in model.modules()}
        self.rng = save_rng()

    def grads_for(self, params: list[torch.nn.Parameter]) -> list[torch.Tensor | None] | None:
        """This rank's saved ``.grad`` (local parts) of each of ``params``; None when there was none."""
        by_id = {id(p): g for p, g in zip(self.params, self.saved)}
        out = [by_id.get(id(p)) for p in params]
        return None if all(g is None for g in out) else out

    @torch.no_grad()
    def restore(self) -> None:
        for p, g, saved, rg in zip(self.params, self.grads, self.saved, self.requires_grad):
            if g is not None:
                local_part(g).copy_(saved)
            p.grad = g
            p.requires_grad_(rg)
        for b, saved in self.buffers:
            local_part(b).copy_(saved)
        for m, training in self.modes.items():
            m.training = training
        restore_rng(self.rng)

    def recover_fsdp(self) -> None:
        """After an aborted search: FSDP2 modules back to their sharded parameters.

        A forward whose backward never ran (the probe every rank left together) leaves FSDP2's
        root holding its gathered parameters; the optimizer then steps the shards and the next
        forward would compute with the stale gathered values. ``reset_iter_state`` (torch 2.13,
        on the outermost FSDP modules) also clears a forward stopped midway; ``reshard`` (local,
        no collective) covers older torch."""
        fsdp = _fsdp_modules(self.modes)
        nested = {id(c) for m in fsdp for c in m.modules() if c is not m}
        for m in fsdp:
            reset = getattr(m, "reset_iter_state", None)
            if reset is not None and id(m) not in nested:
                try:
                    reset()
                except RuntimeError:  # not FSDP's root (the model handed to locate sits inside it)
                    pass
        for m in fsdp:
            m.reshard()


def _fsdp_modules(modules) -> list:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch < 2.6: FSDP2 lived under _composable (or not at all)
        try:
            from torch.distributed._composable.fsdp import FSDPModule
        except ImportError:
            return []
    return [m for m in modules if isinstance(m, FSDPModule)]
